"""Metrics and steps as users pass them to ``log``, turned into validated plain data on the caller's thread (a bad
value raises at the call that made it, never later inside delivery). Torch is never imported: tensors are recognised
by their type's module."""

from __future__ import annotations

import numbers
import sys
from collections.abc import Mapping
from typing import Any

from rllog.errors import InvalidKey, InvalidStep, InvalidValue
from rllog.validate.nesting import MAX_NESTING_DEPTH, _too_deep

INT64_MAX = 2**63 - 1  # every tracker stores steps as int64


def check_step(step: Any) -> int:
    """``step`` as a Python int.

    Raises:
        InvalidStep: anything but an integer (numpy integers are accepted) in ``[0, 2**63 - 1]``.
    """
    if type(step) is int and 0 <= step <= INT64_MAX:
        return step
    if isinstance(step, bool) or not hasattr(step, "__index__"):
        raise InvalidStep(f"step must be a non-negative int, got {type(step).__name__}: {step!r}")
    step = step.__index__()  # numpy integers
    if not 0 <= step <= INT64_MAX:
        raise InvalidStep(f"step must be an int in [0, 2**63 - 1] (every tracker stores steps as int64), got {step}")
    return step


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


def flatten(values: Mapping[str, Any], prefix: str = "", into: dict[str, Any] | None = None) -> dict[str, Any]:
    """Flatten nested mappings with ``/``: ``{"a": {"b": 1}}`` -> ``{"a/b": 1}`` (into ``into`` if given).

    Raises:
        InvalidKey: two entries flatten to one name (``{"a/b": 1, "a": {"b": 2}}``), or a bad name.
        InvalidValue: ``values`` is not a mapping, or nests more than :data:`MAX_NESTING_DEPTH` levels
            (or contains itself).
    """
    if type(values) is not dict and not isinstance(values, Mapping):
        raise InvalidValue(f"log() takes a dict of metrics, got {type(values).__name__}")
    flat: dict[str, Any] = {} if into is None else into
    _flatten_into(values, prefix, flat, 1)
    return flat


def _flatten_into(values: Mapping[str, Any], prefix: str, flat: dict[str, Any], depth: int) -> None:
    for key, value in values.items():
        if type(key) is str and key and key.isascii():  # the common case, checked inline (hot path)
            name = prefix + key if prefix else key
        else:
            name = _name(prefix, key)
        if type(value) is dict or (type(value) not in _SCALARS and isinstance(value, Mapping)):
            if depth >= MAX_NESTING_DEPTH:
                raise InvalidValue(_too_deep(f"metric {name!r}", value))
            _flatten_into(value, name + "/", flat, depth + 1)
        elif name in flat:
            raise InvalidKey(
                f"metric {name!r} is given twice once nested dicts are flattened with '/' (e.g. {{'a/b': 1, 'a': {{'b': 2}}}}); "
                "log it under one name"
            )
        else:
            flat[name] = value


_SCALARS = (float, int, bool)
_NUMBERS = {float, int}
_STR = {str}


def to_scalar(key: str, value: Any) -> Any:
    """Return ``value`` as a Python float, or the one-element tensor itself (stacked and converted later in bulk).

    Raises:
        InvalidValue: for anything that is not one real number.
    """
    try:
        return _to_scalar(key, value)
    except OverflowError:
        raise InvalidValue(f"metric {key!r}: {value!r:.80} is beyond a float's range") from None


def _to_scalar(key: str, value: Any) -> Any:
    cls = type(value)
    if cls is float:
        return value
    if cls is int or cls is bool:
        return float(value)
    if is_tensor(value):
        if value.numel() != 1 or value.is_complex():
            raise InvalidValue(f"metric {key!r}: a tensor must hold exactly one real number, got shape {tuple(value.shape)}")
        if value.is_meta:  # it would stack fine, then fail the host copy on the journal writer thread
            raise InvalidValue(f"metric {key!r}: {_unreadable(value)} cannot be read as a number")
        return value  # detached and reshaped with the others in one op by stack_scalars
    if isinstance(value, numbers.Real):  # numpy floats/ints, Decimal, Fraction
        return float(value)
    if cls.__module__ == "numpy":  # np.bool_, 0-d arrays
        if getattr(value, "size", None) == 1 and getattr(value, "dtype", None) is not None and value.dtype.kind in "biuf":
            return float(value.item())
        raise InvalidValue(
            f"metric {key!r}: numpy value of shape {getattr(value, 'shape', '?')} and dtype {getattr(value, 'dtype', '?')} is not one real number"
        )
    raise InvalidValue(
        f"metric {key!r}: expected a real number (int, float, bool, numpy or 0-d torch scalar), got {cls.__name__}: {value!r:.80}"
    )


def _unreadable(tensor: Any) -> str:
    """What makes ``tensor`` impossible to copy to the host as one number."""
    if tensor.is_meta:
        return "a tensor on the 'meta' device (it holds no data)"
    if tensor.is_quantized:
        return "a quantized tensor"
    if tensor.is_nested:
        return "a nested tensor"
    return f"a tensor with layout {tensor.layout}"


def normalise_metrics(values: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, Any]]:
    """Split validated metrics into Python floats and one-element tensors (``{}`` when none).

    This is the hot path of ``Run.log``: plain floats take the shortest way through.
    """
    if type(values) is dict and values:
        # The common case, checked with C-level loops: flat, ASCII names, Python floats (and ints).
        kinds = set(map(type, values.values()))
        if kinds <= _NUMBERS and set(map(type, values)) == _STR and all(map(str.isascii, values)) and "" not in values:
            if int in kinds:
                try:
                    return {k: float(v) for k, v in values.items()}, {}
                except OverflowError:
                    pass  # an int beyond a float's range: the slow path names the key
            else:
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
        # The common case; mixed dtypes would be promoted to a lossy common one (int64 + bf16 -> bf16).
        if len({t.dtype for t in tensors}) == 1:
            try:
                return torch.stack(tensors).reshape(-1).to(torch.float64)
            except RuntimeError:  # mixed shapes ((), (1,), ...) or devices
                pass
        # gather on the accelerator (never a sync to the host here), each value converted to float64 on its own first
        device = next((t.device for t in tensors if t.device.type != "cpu"), tensors[0].device)
        try:
            return torch.stack([t.reshape(()).to(device, torch.float64, non_blocking=True) for t in tensors])
        except (RuntimeError, NotImplementedError, TypeError) as exc:  # sparse, quantized, nested: vetted off the hot path
            kinds = sorted({_unreadable(t) for t in tensors if t.layout is not torch.strided or t.is_quantized or t.is_nested})
            raise InvalidValue(
                f"tensor metrics must be dense, unquantized tensors (log value.item() instead); got {', '.join(kinds) or exc}"
            ) from exc
