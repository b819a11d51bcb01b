"""How deep a logged value may nest, checked without recursion: one rule for metrics, table cells and configs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rllog.errors import InvalidValue

# How many levels of dicts and lists a metric, a table cell or a config may nest. Deeper, or a value that contains
# itself (which nests forever), is refused at the call: walking it would exceed Python's recursion limit (1,000
# frames, a bare RecursionError), pyarrow crashes the process on a table cell that contains itself, and Parquet
# reads back at most ~120 levels of nested struct. Real configs nest a few levels (TrainingArguments: 3).
MAX_NESTING_DEPTH = 100
# Containers a too-deep value's check walks to tell "contains itself" from "deep" (the error path only).
SELF_REFERENCE_WALK_LIMIT = 10_000


def _children(value: Any) -> Any:
    """The values inside a dict or list (tuple, set), for the nesting checks; () for anything else."""
    if isinstance(value, Mapping):
        return value.values()
    if isinstance(value, (list, tuple, set, frozenset)):
        return value
    return ()


def _contains_itself(value: Any) -> bool:
    """Whether ``value`` is reachable from inside itself (walked without recursion, at most
    :data:`SELF_REFERENCE_WALK_LIMIT` containers)."""
    seen: set[int] = set()
    stack = list(_children(value))
    while stack and len(seen) < SELF_REFERENCE_WALK_LIMIT:
        item = stack.pop()
        if item is value:
            return True
        if id(item) not in seen and _children(item):
            seen.add(id(item))
            stack.extend(_children(item))
    return False


def _too_deep(what: str, value: Any) -> str:
    """Why a value nested past :data:`MAX_NESTING_DEPTH` is refused; ``value`` is the container at that depth."""
    what = what if len(what) <= 200 else what[:150] + "..." + what[-40:]
    if _contains_itself(value):
        return f"{what} contains itself (a dict or list that refers to itself nests forever); log plain values"
    return f"{what} nests more than {MAX_NESTING_DEPTH} levels of dicts or lists (MAX_NESTING_DEPTH); log a flatter value"


def check_nesting(what: str, value: Any) -> None:
    """Raise unless ``value`` (a table cell) nests at most :data:`MAX_NESTING_DEPTH` levels of dicts and lists.

    Raises:
        InvalidValue: deeper, or a value that contains itself; the message names ``what``.
    """
    level, depth = [value], 1
    while level:
        # one entry per container object: a value that holds one list twice, or itself, does not multiply its level
        inner = list({id(child): child for item in level for child in _children(item) if _children(child)}.values())
        if inner and depth >= MAX_NESTING_DEPTH:
            raise InvalidValue(_too_deep(what, inner[0]))
        level, depth = inner, depth + 1
