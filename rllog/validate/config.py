"""Configs (``init(config=...)``, ``update_config``) flattened with ``/`` into JSON-friendly values, secrets redacted."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from rllog.errors import InvalidValue
from rllog.validate.nesting import MAX_NESTING_DEPTH, _too_deep
from rllog.validate.secrets import REDACTED, _as_mapping, _keeps_no_secret, _redact, is_secret_key, redact_text


def flatten_config(config: Any, prefix: str = "", keep_lists: bool = False) -> dict[str, Any]:
    """Flatten a config (dict, dataclass such as ``TrainingArguments``, or object with ``to_dict``) with ``/``,
    secrets redacted (the rule is :func:`redact`'s; see docs/decisions.md, "Secrets").

    Values are kept when they are JSON scalars, otherwise stringified (after redaction). With ``keep_lists``,
    a list (tuple, set) of JSON scalars stays a list (``report_to: ["wandb"]``), for the trackers that take lists.

    Raises:
        InvalidValue: not a config, or nested more than :data:`MAX_NESTING_DEPTH` levels (or containing itself).
    """
    return _flatten_config(config, prefix, keep_lists, 1)


def _flatten_config(config: Any, prefix: str, keep_lists: bool, depth: int) -> dict[str, Any]:
    if config is None:
        return {}
    mapping = _as_mapping(config)
    if mapping is None:
        if not hasattr(config, "__dict__"):
            raise InvalidValue(f"config must be a dict, a dataclass or an object with to_dict(), got {type(config).__name__}")
        mapping = {k: v for k, v in vars(config).items() if not k.startswith("_")}
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if is_secret_key(str(key)) and not _keeps_no_secret(value):
            flat[name] = REDACTED
        elif (fields := _nested_config(value)) is not None:
            if depth >= MAX_NESTING_DEPTH:
                raise InvalidValue(_too_deep(f"config key {name!r}", value))
            flat.update(_flatten_config(fields, name + "/", keep_lists, depth + 1))
        elif value is None or isinstance(value, (bool, int)):
            flat[name] = value
        elif isinstance(value, float):
            flat[name] = value if math.isfinite(value) else str(value)
        elif isinstance(value, str):
            flat[name] = redact_text(value)
        elif isinstance(value, (list, tuple, set, frozenset)):  # redacted item by item (a dict in a list has keys too)
            redacted = _redact(value, f"config/{name}", depth + 1)
            if keep_lists and all(_is_json_scalar(item) for item in redacted):
                flat[name] = redacted
            else:
                flat[name] = str(value) if redacted == list(value) else str(redacted)
        else:  # bytes, objects: their text, redacted (a dataclass's repr shows `password='...'`)
            flat[name] = redact_text(str(value))
    return flat


def _nested_config(value: Any) -> Mapping | None:
    """A config value's fields when it is a config of its own: a mapping, a dataclass instance or an
    ``argparse.Namespace`` (what Lightning's MLflow and TensorBoard loggers expand: ``cfg/lr``); else None, and the
    value is kept as its text. A dataclass's fields are read as they are (``asdict`` would deep-copy them: a lock
    field cannot be)."""
    if isinstance(value, Mapping):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if type(value).__name__ == "Namespace" and hasattr(value, "__dict__"):
        return vars(value)
    return None


def _is_json_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, str)) or (isinstance(value, float) and math.isfinite(value))
