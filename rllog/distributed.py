"""Multi-process runs: reduce metrics across ranks, gather table rows to rank 0.

Used when ``torch.distributed`` is initialised (torchrun, accelerate, deepspeed set it up); nothing
here imports torch otherwise. Collectives run on the caller's thread, inside ``Run.log`` /
``Run.log_table``, so every rank must make the same ``log`` calls in the same order (as with any
collective). Keys are unioned and sorted before any collective, so ranks that logged different keys
still issue identical collectives.

Reduction by name (the last ``/`` component of the key):

- ``min``: ends with ``min`` (``low_min``, ``min``) or starts with ``min_`` (``min_length``);
- ``max``: ends with ``max`` or starts with ``max_``;
- ``sum`` (counters): starts with ``num_``, ends with ``_count``, ``_total`` or ``_sum``, or is ``count``,
  ``total_flos``;
- ``mean``: everything else.

NaN values and keys a rank did not log are ignored; a key with no value on any rank is NaN.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

COUNTER_NAMES = {"count", "total_flos"}


def reduction(key: str) -> str:
    """``"min"``, ``"max"``, ``"sum"`` or ``"mean"`` for a metric name."""
    leaf = key.rsplit("/", 1)[-1].lower()
    if leaf.endswith("min") or leaf.startswith("min_"):
        return "min"
    if leaf.endswith("max") or leaf.startswith("max_"):
        return "max"
    if leaf.startswith("num_") or leaf.endswith(("_count", "_total", "_sum")) or leaf in COUNTER_NAMES:
        return "sum"
    return "mean"


def _dist():
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def global_rank() -> int:
    """This process's global rank: from ``torch.distributed`` if initialised, else ``$RANK``, else 0."""
    dist = _dist()
    if dist is not None:
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def is_distributed() -> bool:
    return _dist() is not None


def reduce_metrics(values: dict[str, float]) -> dict[str, float]:
    """Reduce host floats across every rank (a collective: every rank must call it). Returns the result on every rank."""
    dist = _dist()
    if dist is None:
        return values
    torch = sys.modules["torch"]
    key_sets: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(key_sets, sorted(values))
    keys = sorted(set().union(*key_sets))
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    raw = torch.tensor([values.get(k, math.nan) for k in keys], dtype=torch.float64, device=device)
    present = ~torch.isnan(raw)
    sums = torch.where(present, raw, torch.zeros_like(raw))
    counts = present.to(torch.float64)
    mins = torch.where(present, raw, torch.full_like(raw, math.inf))
    maxs = torch.where(present, raw, torch.full_like(raw, -math.inf))
    stacked = torch.stack([sums, counts])
    dist.all_reduce(stacked, op=dist.ReduceOp.SUM)
    dist.all_reduce(mins, op=dist.ReduceOp.MIN)
    dist.all_reduce(maxs, op=dist.ReduceOp.MAX)
    sums, counts = stacked.tolist()
    mins, maxs = mins.tolist(), maxs.tolist()
    out = {}
    for i, key in enumerate(keys):
        if counts[i] == 0:
            out[key] = math.nan
            continue
        how = reduction(key)
        out[key] = {"min": mins[i], "max": maxs[i], "sum": sums[i], "mean": sums[i] / counts[i]}[how]
    return out


def gather_rows(rows: list[dict]) -> list[dict] | None:
    """Every rank's table rows, in rank order, on rank 0 (None elsewhere). A collective."""
    dist = _dist()
    if dist is None:
        return rows
    gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(rows, gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    return [row for part in gathered for row in part]
