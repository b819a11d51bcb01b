"""What the tracker backends share: which of a run's values are rllog's defaults, the trackers' own
environment variables, and the tracker run a backend chose for an rllog run.

Each backend settles every setting the same way, first match wins:

1. an explicit value: the backend's option (``backend_options``), or ``rllog.init``'s ``project`` /
   ``name`` when they are not rllog's defaults (:func:`explicit_project`, :func:`explicit_name`);
2. the tracker's own environment variable (``WANDB_PROJECT``, ``MLFLOW_RUN_ID``, ...), as
   transformers' callbacks and the trackers themselves read them;
3. what an earlier session of the same rllog run chose (:class:`Remembered`): a resume, or
   ``rllog replay`` from a shell without the variables, continues the same tracker run;
4. rllog's default (the rllog project, name and a tracker id derived from the run id).

``rllog.init`` gives every run a project (default ``"rllog"``) and a name (default ``"run-<run id>"``);
a sink cannot tell a default from a user who chose those very values, so those values count as
defaults, and so does ``"huggingface"``, the default of ``TrainingArguments.project`` that the
transformers/TRL integration passes on (transformers' own ``WandbCallback`` lets ``WANDB_PROJECT`` win
over it too).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rllog.files import replace_file
from rllog.records import RunInfo

log = logging.getLogger(__name__)

TRANSFORMERS_PROJECT = "huggingface"  # TrainingArguments.project's default, passed on by the transformers integration
DEFAULT_PROJECTS = ("rllog", TRANSFORMERS_PROJECT)  # rllog.init's default project; TrainingArguments.project's default
TRANSFORMERS_LAYOUT = "transformers"  # a ``config_layout`` option: the config as transformers' own callbacks give it
MODEL_PREFIX = "model/"  # where the transformers integration puts the model config (and num_parameters)
MODEL_PARAMETERS_KEY = "model/num_parameters"  # the one model key transformers' callbacks log under this very name
REMEMBERED_DIR = "trackers"  # below RUN_DIR: <tracker>.json, the tracker run chosen for this rllog run
RUN_ID_KEY = "rllog_run_id"  # in that file: the rllog run it belongs to


def explicit_project(run_info: RunInfo) -> str | None:
    """``run_info.project`` when the user chose it (anything but the defaults ``"rllog"`` and ``"huggingface"``), else None."""
    return run_info.project if run_info.project and run_info.project not in DEFAULT_PROJECTS else None


def explicit_name(run_info: RunInfo) -> str | None:
    """``run_info.name`` when the user chose it (anything but rllog's default ``"run-<run id>"``), else None."""
    return run_info.name if run_info.name and run_info.name != f"run-{run_info.run_id}" else None


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """A flattened config (``a/b`` keys) as nested dicts again (``{"a": {"b": ...}}``), for the trackers that keep
    nested config. A key that has a value of its own and is a prefix of others (``a`` and ``a/b``) stays flat:
    ``{"a": ..., "a/b": ...}``.

    Example:
        >>> nest({"lr": 0.1, "accelerator_config/split_batches": False})
        {'lr': 0.1, 'accelerator_config': {'split_batches': False}}
    """
    keys = {str(k) for k in flat}
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        parts = str(key).split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts))]
        if any(prefix in keys for prefix in prefixes):
            nested[str(key)] = value
            continue
        node = nested
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return nested


def split_transformers_config(flat: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A config from the transformers integration as (TrainingArguments, model config, what transformers' callbacks
    log under its own name: ``model/num_parameters``), each still flat."""
    args, model, own = {}, {}, {}
    for key, value in flat.items():
        if key == MODEL_PARAMETERS_KEY:
            own[key] = value
        elif key.startswith(MODEL_PREFIX):
            model[key[len(MODEL_PREFIX) :]] = value
        else:
            args[key] = value
    return args, model, own


def env(name: str) -> str | None:
    """The environment variable ``name``, or None when it is unset or blank."""
    value = os.environ.get(name, "").strip()
    return value or None


def first(*values: Any) -> Any:
    """The first value that is not None and not an empty string or collection (None if there is none)."""
    return next((v for v in values if v is not None and not (isinstance(v, (str, list, tuple, dict)) and not v)), None)


def remember_location(run_info: RunInfo, tracker: str, **where: Any) -> None:
    """Record where ``tracker`` keeps this run's data (``RUN_DIR/trackers/<tracker>.json``): what a user needs to
    open it (a folder, a file, a URL, an id); ``finish`` and ``rllog show`` print it (``rllog.rundir.tracker_location``)."""
    Remembered(run_info.run_dir, tracker, run_info.run_id).save(**where)


class Remembered:
    """The tracker run a backend chose for an rllog run, kept in ``RUN_DIR/trackers/<tracker>.json``.

    Best effort: a file that cannot be read or written is ignored with a warning (the backend then
    decides as on a first session). The file names the rllog run id it belongs to, so a run directory
    reused by another run does not inherit it.

    Example:
        >>> remembered = Remembered(run_info.run_dir, "wandb", run_info.run_id)   # doctest: +SKIP
        >>> run_id = first(option, env("WANDB_RUN_ID"), remembered.get("id"), derived)   # doctest: +SKIP
        >>> remembered.save(id=run_id)   # doctest: +SKIP
    """

    def __init__(self, run_dir: str | os.PathLike, tracker: str, run_id: str):
        self.path = Path(run_dir) / REMEMBERED_DIR / f"{tracker}.json"
        self.run_id = run_id
        self.values = self._load()

    def get(self, key: str) -> Any:
        return self.values.get(key)

    def save(self, **values: Any) -> None:
        """Remember ``values`` (merged into what is already there); written only when something changed."""
        merged = {**self.values, **{k: v for k, v in values.items() if v is not None}}
        if merged == self.values and self.path.is_file():
            return
        try:
            replace_file(self.path, json.dumps({**merged, RUN_ID_KEY: self.run_id}, indent=1, sort_keys=True))
            self.values = merged
        except OSError as exc:
            log.warning("rllog: cannot write %s (a later session decides its tracker run again): %s", self.path, exc)

    def _load(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("rllog: ignoring unreadable %s: %s", self.path, exc)
            return {}
        if not isinstance(data, dict) or data.pop(RUN_ID_KEY, None) != self.run_id:
            return {}
        return data
