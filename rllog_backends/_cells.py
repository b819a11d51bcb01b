"""One table-cell policy for every backend that hands a tracker a table as rows of plain values.

A ``log_table`` cell reaches a sink as what ``pyarrow.Table.to_pylist`` gives: None, bool, int, float, str,
bytes, lists and dicts (Arrow lists and structs), dates and times, ``Decimal``. The trackers' tables are JSON
(wandb's ``.table.json``, MLflow's ``log_table`` artifact, DVCLive's ``tables/*.json``) or take scalars only
(SwanLab's echarts table, ClearML's table plot). :func:`cell` turns a value into one those accept, the same way
for every tracker (docs/sink-protocol.md, "Table cells"):

========================== =====================================================================================
value                      cell
========================== =====================================================================================
None, bool, int, str       as it is (None is an empty cell)
finite float               as it is
NaN, +inf, -inf            None: strict JSON has no number for them (pandas writes them the same way); the journal
                           and the Parquet store keep the float
bytes                      decoded as UTF-8, an invalid byte as ``\\xNN`` (``backslashreplace``): text, and
                           nothing lost
list, tuple, dict          ``nested=True``: a list / dict of cells (dict keys as ``str``); ``nested=False``
                           (a tracker whose table takes scalars only): that value as compact JSON text
date, time, datetime       ISO 8601 text (``isoformat``)
a 0-d numpy/torch value    its Python scalar (``.item()``), then as above
anything else              ``str(value)`` (``Decimal`` keeps every digit)
========================== =====================================================================================

Example:
    >>> [cell(v) for v in (None, 1, 0.5, float("nan"), b"ok\\xff", "a")]
    [None, 1, 0.5, None, 'ok\\\\xff', 'a']
    >>> cell({"k": [1.0, float("inf")]}), cell({"k": [1.0, float("inf")]}, nested=False)
    ({'k': [1.0, None]}, '{"k": [1.0, null]}')
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["cell"]


def cell(value: Any, *, nested: bool = True) -> Any:
    """``value`` as a table cell (the module's table says how each type is written)."""
    value = _scalar(value)
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", errors="backslashreplace")
    if isinstance(value, (list, tuple, dict)):
        inner = _nested(value)
        return inner if nested else json.dumps(inner, ensure_ascii=False, allow_nan=False)
    isoformat = getattr(value, "isoformat", None)
    if callable(isoformat):
        return isoformat()
    return str(value)


def _nested(value: list | tuple | dict) -> Any:
    if isinstance(value, dict):
        return {str(k): cell(v) for k, v in value.items()}
    return [cell(v) for v in value]


def _scalar(value: Any) -> Any:
    """A 0-d numpy or torch value as its Python scalar (neither imported: only what has ``item`` and no dimensions)."""
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", None) == 0:
        return item()
    return value
