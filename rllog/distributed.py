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


# The sorted union of the keys every rank has logged so far: the same list on every rank, since it only
# changes after an all_gather. While no rank logs a key outside it, a reduction needs no key exchange.
_known_keys: list[str] = []
MAX_KNOWN_KEYS = 10_000  # past this, start again from the current call's keys (runs that invent keys every step)


def reset() -> None:
    """Forget the known keys (``rllog.init`` calls it on every rank: a new run, perhaps a new process group)."""
    global _known_keys
    _known_keys = []


def reduce_metrics(values: dict[str, float]) -> dict[str, float]:
    """Reduce host floats across every rank (a collective: every rank must call it). Returns the result on every rank.

    Two ``all_reduce`` calls per step (sum and count; max, -min and a "new key" flag) with one copy to
    the host; the key lists are exchanged (``all_gather_object``) only when some rank logs a key no
    rank has logged before.
    """
    global _known_keys
    dist = _dist()
    if dist is None:
        return values
    result = _reduce_over(dist, _known_keys, values)
    if result is None:  # some rank has a new key: exchange key lists, then reduce again
        key_sets: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(key_sets, sorted(values))
        current = set().union(*key_sets)
        union = current | set(_known_keys)
        _known_keys = sorted(union if len(union) <= MAX_KNOWN_KEYS else current)
        result = _reduce_over(dist, _known_keys, values)
    assert result is not None  # every rank now knows every key
    return result


def _reduce_over(dist, keys: list[str], values: dict[str, float]) -> dict[str, float] | None:
    """Reduce ``values`` over the agreed ``keys``; None (on every rank) when a rank logged a key not in them."""
    torch = sys.modules["torch"]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    new_key = float(not values.keys() <= set(keys))
    raw = torch.tensor([values.get(k, math.nan) for k in keys], dtype=torch.float64, device=device)
    logged = torch.tensor([k in values for k in keys], dtype=torch.float64, device=device)
    present = ~torch.isnan(raw)
    sums = torch.stack([torch.where(present, raw, 0.0), present.to(torch.float64), logged])
    extremes = torch.cat(
        [
            torch.where(present, raw, -math.inf),
            torch.where(present, -raw, -math.inf),
            torch.tensor([new_key], dtype=torch.float64, device=device),
        ]
    )
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    n = len(keys)
    flat = torch.cat([sums.reshape(-1), extremes]).tolist()  # the one copy to the host
    if flat[-1] > 0:
        return None
    total, counts, logged_by = flat[:n], flat[n : 2 * n], flat[2 * n : 3 * n]
    maxs, neg_mins = flat[3 * n : 4 * n], flat[4 * n : 5 * n]
    out = {}
    for i, key in enumerate(keys):
        if logged_by[i] == 0:  # known from an earlier step, logged by no rank now
            continue
        if counts[i] == 0:
            out[key] = math.nan
            continue
        how = reduction(key)
        out[key] = {"min": -neg_mins[i], "max": maxs[i], "sum": total[i], "mean": total[i] / counts[i]}[how]
    return out


def gather_rows(rows: list[dict]) -> list[dict] | None:
    """Every rank's table rows, in rank order, on rank 0 (None elsewhere). A collective."""
    dist = _dist()
    if dist is None:
        return rows
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(rows, gathered, dst=0)
    if gathered is None:  # not rank 0
        return None
    return [row for part in gathered for row in part]
