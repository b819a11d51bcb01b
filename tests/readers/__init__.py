"""Read each tracker's own storage back, for tests that prove the data arrived.

Each backend has ``tests/readers/<backend>.py`` with ``read_back(env, run_info) -> ReadBack``, where
``env`` is the ``tracker_dirs`` fixture's dict (tracker storage paths) and ``run_info`` the run's
:class:`rllog.records.RunInfo`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ReadBack:
    """What a tracker stored, in its own names.

    Attributes:
        metrics: metric name -> [(step, value), ...] in the order the tracker stored them.
        tables: table name -> [(step, rows), ...]; rows are dicts of the user's columns.
        config: the run's hyperparameters as the tracker stores them.
        status: the run's final state mapped to "finished" / "failed" / "killed" (None if not stored).
        alerts: health alerts as the tracker stores them: dicts with at least "title", "text", "level".
    """

    metrics: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    tables: dict[str, list[tuple[int, list[dict[str, Any]]]]] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    status: str | None = None
    alerts: list[dict[str, Any]] = field(default_factory=list)


def read_back(backend: str, env: dict, run_info) -> ReadBack:
    return importlib.import_module(f"readers.{backend}").read_back(env, run_info)
