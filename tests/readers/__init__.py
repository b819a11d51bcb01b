"""Read each tracker's own storage back, for tests that prove the data arrived.

Each backend has ``tests/readers/<backend>.py``; adding one puts the backend in the contract suite
(``tests/test_backend_contract.py``). A reader module has:

- ``read_back(env, run_info) -> ReadBack`` (required), where ``env`` is the ``tracker_dirs``
  fixture's dict (tracker storage paths) and ``run_info`` the run's :class:`rllog.records.RunInfo`.

and, where the tracker differs from "stores what it was given" (the defaults), any of:

- ``OPTIONS``: the sink's options in the suite (``registry.create(backend, OPTIONS)``).
- ``prepare(monkeypatch, env)``: per-test set-up of the tracker's storage under ``env``.
- ``stored(value)``: a metric value (NaN and ±inf included) as the tracker gives it back.
- ``cell(value)``: a table cell as the tracker gives it back.
- ``TABLE_CELLS``: ``"nested"`` or ``"text"`` where the sink converts table cells with ``rllog_backends._cells.cell``
  (lists and dicts kept nested, or as JSON text); unset where the tracker stores tables its own way.
- ``config_value(value)``: a config value as the tracker gives it back.
- ``config_update_value(original, new)``: what the tracker gives back for a key given ``original`` at
  open (None: a new key) and ``new`` after it (``write_config``).
- ``SUPERSEDES``: the tracker hides what an earlier attempt wrote from the step a later attempt
  restarted at (TensorBoard's purge); otherwise it keeps every point.
- ``alert_level(level)``: an alert's level ("warning" / "error") as the tracker stores it.
- ``run_ids(env, run_info) -> set``: the tracker runs in ``env``'s storage (resuming must not add one).
- ``break_next_write(monkeypatch, sink)``: arm a one-shot fault in the tracker's own write path that
  fires after the tracker took part of the next ``write_metrics`` (or its flush), the way the tracker
  fails (its own exception, or the OS's ``ENOSPC``).
- ``DISK_FULL_SKIP``: why a full disk cannot be tested through the sink's calls (the tracker writes
  in its own process); unset where it can.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

BACKENDS = sorted(p.stem for p in Path(__file__).parent.glob("*.py") if p.stem != "__init__")


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


def _same(value: Any) -> Any:
    return value


DEFAULTS: dict[str, Any] = {
    "OPTIONS": {},
    "prepare": lambda monkeypatch, env: None,
    "stored": _same,
    "cell": _same,
    "TABLE_CELLS": None,
    "config_value": _same,
    "config_update_value": None,
    "SUPERSEDES": False,
    "alert_level": _same,
    "run_ids": None,
    "break_next_write": None,
    "DISK_FULL_SKIP": None,
}


def reader(backend: str) -> ModuleType:
    return importlib.import_module(f"readers.{backend}")


def hook(backend: str, name: str) -> Any:
    """The reader's ``name`` (see above), or its default."""
    if name == "config_update_value" and not hasattr(reader(backend), name):
        config_value = hook(backend, "config_value")
        return lambda original, new: config_value(new)
    return getattr(reader(backend), name, DEFAULTS[name])


def read_back(backend: str, env: dict, run_info) -> ReadBack:
    return reader(backend).read_back(env, run_info)
