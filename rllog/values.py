"""Turning what users pass to ``log``/``log_table``/``init(config=...)`` into validated plain data.

All validation happens here, on the caller's thread, so a bad value raises at the call that made it
(never later inside delivery). Torch is never imported: tensors are recognised by their type's module.
"""

from __future__ import annotations

import math
import numbers
import re
import sys
from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from rllog.errors import InvalidKey, InvalidTable, InvalidValue

RESERVED_TABLE_COLUMNS = ("_step", "_seq")
# `*token*` but not `tokenizer*`; only string values are redacted (an int `pad_token_id` is no secret).
SECRET_KEY = re.compile(r"token(?!izer)|api_?key|secret|password|passwd", re.IGNORECASE)
REDACTED = "***REDACTED***"


def is_tensor(value: Any) -> bool:
    """True for a torch.Tensor (checked without importing torch)."""
    cls = type(value)
    return cls.__module__.startswith("torch") and hasattr(value, "numel") and hasattr(value, "detach")


def _name(prefix: str, key: Any) -> str:
    if type(key) is not str or not key:
        raise InvalidKey(f"metric names must be non-empty strings, got {key!r}")
    name = prefix + key if prefix else key
    if not name.isascii():
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidKey(f"metric name {name!r} is not valid Unicode text (it holds a lone surrogate)") from None
    return name


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested mappings with ``/``: ``{"a": {"b": 1}}`` -> ``{"a/b": 1}``."""
    if type(values) is not dict and not isinstance(values, Mapping):
        raise InvalidValue(f"log() takes a dict of metrics, got {type(values).__name__}")
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if type(key) is str and key and key.isascii():  # the common case, checked inline (hot path)
            name = prefix + key if prefix else key
        else:
            name = _name(prefix, key)
        if type(value) is dict or (type(value) not in _SCALARS and isinstance(value, Mapping)):
            flat.update(flatten(value, name + "/"))
        else:
            flat[name] = value
    return flat


_SCALARS = (float, int, bool)
_NUMBERS = {float, int}
_STR = {str}


def to_scalar(key: str, value: Any) -> Any:
    """Return ``value`` as a Python float, or the one-element tensor itself (stacked and converted later in bulk).

    Raises:
        InvalidValue: for anything that is not one real number.
    """
    cls = type(value)
    if cls is float:
        return value
    if cls is int or cls is bool:
        return float(value)
    if is_tensor(value):
        if value.numel() != 1 or value.is_complex():
            raise InvalidValue(f"metric {key!r}: a tensor must hold exactly one real number, got shape {tuple(value.shape)}")
        return value  # detached and reshaped with the others in one op by stack_scalars
    if isinstance(value, numbers.Real):  # numpy floats/ints, Decimal, Fraction
        return float(value)
    if cls.__module__ == "numpy":  # np.bool_, 0-d arrays
        if getattr(value, "size", None) == 1 and getattr(value, "dtype", None) is not None and value.dtype.kind in "biuf":
            return float(value.item())
        raise InvalidValue(f"metric {key!r}: numpy value of shape {getattr(value, 'shape', '?')} and dtype {getattr(value, 'dtype', '?')} is not one real number")
    raise InvalidValue(f"metric {key!r}: expected a real number (int, float, bool, numpy or 0-d torch scalar), got {cls.__name__}: {value!r:.80}")


def normalise_metrics(values: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, Any]]:
    """Split validated metrics into Python floats and one-element tensors (``{}`` when none).

    This is the hot path of ``Run.log``: plain floats take the shortest way through.
    """
    if type(values) is dict and values:
        # The common case, checked with C-level loops: flat, ASCII names, Python floats (and ints).
        kinds = set(map(type, values.values()))
        if kinds <= _NUMBERS and set(map(type, values)) == _STR and all(map(str.isascii, values)) and "" not in values:
            if int in kinds:
                return {k: float(v) for k, v in values.items()}, {}
            return dict(values), {}
    floats: dict[str, float] = {}
    tensors: dict[str, Any] = {}
    for key, value in flatten(values).items():
        if type(value) is float:
            floats[key] = value
            continue
        scalar = to_scalar(key, value)
        if type(scalar) is float:
            floats[key] = scalar
        else:
            tensors[key] = scalar
    return floats, tensors


def stack_scalars(tensors: list) -> Any:
    """One-element tensors -> one detached float64 tensor of them, on their device, in as few torch ops
    as possible (one ``stack`` in the common case rather than a few small ops per tensor)."""
    torch = sys.modules["torch"]
    with torch.no_grad():
        if len({t.dtype for t in tensors}) == 1:  # the common case; mixed dtypes would be promoted to a lossy common one (int64 + bf16 -> bf16)
            try:
                return torch.stack(tensors).reshape(-1).to(torch.float64)
            except RuntimeError:  # mixed shapes ((), (1,), ...) or devices
                pass
        # gather on the accelerator (never a sync to the host here), each value converted to float64 on its own first
        device = next((t.device for t in tensors if t.device.type != "cpu"), tensors[0].device)
        return torch.stack([t.reshape(()).to(device, torch.float64, non_blocking=True) for t in tensors])


def to_arrow_table(name: str, table: Any) -> pa.Table:
    """Accept a dict of equal-length columns, a list of row dicts, a ``pyarrow.Table`` or a pandas DataFrame.

    Raises:
        InvalidTable: ragged columns (naming each column's length), unsupported input, a column whose
            values mix types pyarrow cannot unify, or a reserved column name.
    """
    if not isinstance(name, str) or not name.strip():
        raise InvalidKey(f"table names must be non-empty strings, got {name!r}")
    try:
        if isinstance(table, pa.Table):
            result = table
        elif isinstance(table, Mapping):
            columns = {str(k): (v.tolist() if hasattr(v, "tolist") else list(v)) for k, v in table.items()}
            lengths = {k: len(v) for k, v in columns.items()}
            if len(set(lengths.values())) > 1:
                detail = ", ".join(f"{k}={n}" for k, n in lengths.items())
                raise InvalidTable(f"table {name!r}: columns have different lengths ({detail})")
            result = pa.table(columns)
        elif isinstance(table, list) and all(isinstance(row, Mapping) for row in table):
            result = pa.Table.from_pylist([{str(k): v for k, v in row.items()} for row in table])
        elif type(table).__name__ == "DataFrame" and hasattr(table, "to_dict"):
            result = pa.Table.from_pandas(table, preserve_index=False)
        else:
            raise InvalidTable(f"table {name!r}: expected a dict of columns, a list of row dicts, a pyarrow.Table or a pandas DataFrame, got {type(table).__name__}")
    except InvalidTable:
        raise
    except UnicodeEncodeError:  # text that is not valid UTF-8 (lone surrogates): replace, as documented
        return to_arrow_table(name, _replace_invalid_text(table))
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as exc:
        raise InvalidTable(f"table {name!r}: a column mixes values of incompatible types or holds unsupported objects: {exc}") from exc
    result = _decode_binary_columns(result)
    if result.num_columns == 0:
        raise InvalidTable(f"table {name!r} has no columns")
    reserved = [c for c in result.column_names if c in RESERVED_TABLE_COLUMNS]
    if reserved:
        raise InvalidTable(f"table {name!r}: column names {reserved} are reserved by rllog")
    if len(set(result.column_names)) != result.num_columns:
        raise InvalidTable(f"table {name!r}: duplicate column names {result.column_names}")
    return result


def _clean_text(value: Any) -> Any:
    return value.encode("utf-8", "replace").decode("utf-8") if isinstance(value, str) else value


def _replace_invalid_text(table: Any) -> Any:
    """The same table with every string made valid UTF-8 (unencodable characters become ``?``)."""
    if isinstance(table, Mapping):
        return {_clean_text(str(k)): [_clean_text(v) for v in (c.tolist() if hasattr(c, "tolist") else c)] for k, c in table.items()}
    if isinstance(table, list):
        return [{_clean_text(str(k)): _clean_text(v) for k, v in row.items()} for row in table]
    if type(table).__name__ == "DataFrame":
        return _replace_invalid_text(table.to_dict(orient="list"))
    return table


def _decode_binary_columns(table: pa.Table) -> pa.Table:
    """Bytes cells become text (invalid UTF-8 sequences replaced by U+FFFD): every tracker takes text."""
    for i, field in enumerate(table.schema):
        if pa.types.is_binary(field.type) or pa.types.is_large_binary(field.type):
            text = [None if v is None else v.decode("utf-8", "replace") for v in table.column(i).to_pylist()]
            table = table.set_column(i, field.name, pa.array(text, pa.string()))
    return table


def flatten_config(config: Any, prefix: str = "") -> dict[str, Any]:
    """Flatten a config (dict, dataclass such as ``TrainingArguments``, or object with ``to_dict``) with ``/``.

    Values are kept when they are JSON scalars, otherwise stringified. Values of keys that look like
    secrets (``*token*`` except ``tokenizer*``, ``*api_key*``, ``*secret*``, ``*password*``) are replaced by
    ``***REDACTED***`` when they are non-empty strings.
    """
    if config is None:
        return {}
    if not isinstance(config, Mapping):
        if hasattr(config, "to_dict"):
            config = config.to_dict()
        elif hasattr(config, "__dataclass_fields__"):
            import dataclasses

            config = dataclasses.asdict(config)
        elif hasattr(config, "__dict__"):
            config = {k: v for k, v in vars(config).items() if not k.startswith("_")}
        else:
            raise InvalidValue(f"config must be a dict, a dataclass or an object with to_dict(), got {type(config).__name__}")
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_config(value, name + "/"))
        elif isinstance(value, str) and value and SECRET_KEY.search(str(key)):
            flat[name] = REDACTED
        elif value is None or isinstance(value, (bool, int, str)):
            flat[name] = value
        elif isinstance(value, float):
            flat[name] = value if math.isfinite(value) else str(value)
        else:
            flat[name] = str(value)
    return flat
