"""Turning what users pass to ``log``/``log_table``/``init(config=...)`` into validated plain data.

All validation happens here, on the caller's thread, so a bad value raises at the call that made it
(never later inside delivery). Torch is never imported: tensors are recognised by their type's module.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import math
import numbers
import re
import sys
import threading
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from rllog.errors import InvalidKey, InvalidStep, InvalidTable, InvalidValue

RESERVED_TABLE_COLUMNS = ("_step", "_seq")
INT64_MAX = 2**63 - 1  # every tracker stores steps as int64
REDACTED = "***REDACTED***"
# A table name's length once percent-encoded: the Parquet store names a directory after it, and file systems allow
# 255 bytes for a name (a longer one failed the whole sink inside delivery: "File name too long").
MAX_TABLE_NAME_ENCODED = 255
# How many levels of dicts and lists a metric, a table cell or a config may nest. Deeper, or a value that contains
# itself (which nests forever), is refused at the call: walking it would exceed Python's recursion limit (1,000
# frames, a bare RecursionError), pyarrow crashes the process on a table cell that contains itself, and Parquet
# reads back at most ~120 levels of nested struct. Real configs nest a few levels (TrainingArguments: 3).
MAX_NESTING_DEPTH = 100
# Containers a too-deep value's check walks to tell "contains itself" from "deep" (the error path only).
SELF_REFERENCE_WALK_LIMIT = 10_000


def table_dir_name(name: str) -> str:
    """A table name as a directory name (the Parquet store's), one-to-one: percent-encoding of everything but
    letters, digits and ``_.-~`` (and of a leading dot). Here, so that the length checked at ``log_table``
    (:data:`MAX_TABLE_NAME_ENCODED`) is the length of the directory the store makes."""
    encoded = urllib.parse.quote(name, safe="")
    return "%2E" + encoded[1:] if encoded.startswith(".") else encoded


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


def to_arrow_table(name: str, table: Any) -> pa.Table:
    """Accept a dict of equal-length columns, a list of row dicts, a ``pyarrow.Table`` or a pandas DataFrame.

    Raises:
        InvalidTable: ragged columns (naming each column's length), unsupported input, a column whose
            values mix types pyarrow cannot unify, or a reserved column name.
    """
    if not isinstance(name, str) or not name.strip():
        raise InvalidKey(f"table names must be non-empty strings, got {name!r}")
    if len(table_dir_name(name)) > MAX_TABLE_NAME_ENCODED:
        raise InvalidKey(
            f"table name {name[:40]!r}... is too long: at most {MAX_TABLE_NAME_ENCODED} characters once percent-encoded "
            "(the Parquet store names a directory after it; non-ASCII characters take 6-12)"
        )
    try:
        if isinstance(table, pa.Table):
            result = table
        elif isinstance(table, Mapping):
            text = [str(k) for k, v in table.items() if isinstance(v, (str, bytes, bytearray))]
            if text:  # list("abc") would make a column of its characters
                raise InvalidTable(
                    f"table {name!r}: columns {text} are text, not columns of values (wrap a single value in a list)"
                )
            columns = {str(k): (v.tolist() if hasattr(v, "tolist") else list(v)) for k, v in table.items()}
            if len(columns) != len(table):
                raise InvalidTable(f"table {name!r}: two column names are equal as text ({list(table)})")
            for column, cells in columns.items():
                _check_cells(name, column, cells)
            lengths = {k: len(v) for k, v in columns.items()}
            if len(set(lengths.values())) > 1:
                detail = ", ".join(f"{k}={n}" for k, n in lengths.items())
                raise InvalidTable(f"table {name!r}: columns have different lengths ({detail})")
            result = pa.table(columns)
        elif isinstance(table, list) and all(isinstance(row, Mapping) for row in table):
            for i, row in enumerate(table):
                for column, cell in row.items():
                    _check_cells(name, str(column), [cell], first_row=i)
            result = pa.Table.from_pylist([{str(k): v for k, v in row.items()} for row in table])
        elif type(table).__name__ == "DataFrame" and hasattr(table, "to_dict"):
            for column in table.columns:
                if table[column].dtype == object:  # Python objects: dicts and lists among them
                    _check_cells(name, str(column), table[column].tolist())
            result = pa.Table.from_pandas(table, preserve_index=False)
        else:
            raise InvalidTable(
                f"table {name!r}: expected a dict of columns, a list of row dicts, a pyarrow.Table or a pandas DataFrame, got {type(table).__name__}"
            )
    except InvalidTable:
        raise
    except UnicodeEncodeError:  # text that is not valid UTF-8 (lone surrogates): replace, as documented
        return to_arrow_table(name, _replace_invalid_text(table))
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as exc:  # OverflowError: an int beyond int64
        raise InvalidTable(
            f"table {name!r}: a column mixes values of incompatible types or holds unsupported objects: {exc}"
        ) from exc
    result = _plain_columns(result)
    if result.num_columns == 0:
        raise InvalidTable(f"table {name!r} has no columns")
    reserved = [c for c in result.column_names if c in RESERVED_TABLE_COLUMNS]
    if reserved:
        raise InvalidTable(f"table {name!r}: column names {reserved} are reserved by rllog")
    if len(set(result.column_names)) != result.num_columns:
        raise InvalidTable(f"table {name!r}: duplicate column names {result.column_names}")
    return result


_FLAT_CELLS = frozenset((str, int, float, bool, bytes, type(None)))


def _check_cells(name: str, column: str, cells: list, first_row: int = 0) -> None:
    """Raise unless every dict or list among ``cells`` nests at most :data:`MAX_NESTING_DEPTH` levels: pyarrow
    would crash the process on a cell that contains itself.

    Raises:
        InvalidTable: naming the table, the column and the row.
    """
    if _FLAT_CELLS.issuperset(map(type, cells)):  # the common case, checked with a C-level loop
        return
    for row, cell in enumerate(cells, first_row):
        if type(cell) not in _FLAT_CELLS and _children(cell):
            try:
                check_nesting(f"table {name!r}, column {column!r}, row {row}:", cell)
            except InvalidValue as exc:
                raise InvalidTable(str(exc)) from None


def _clean_text(value: Any) -> Any:
    return value.encode("utf-8", "replace").decode("utf-8") if isinstance(value, str) else value


def _replace_invalid_text(table: Any) -> Any:
    """The same table with every string made valid UTF-8 (unencodable characters become ``?``)."""
    if isinstance(table, Mapping):
        return {
            _clean_text(str(k)): [_clean_text(v) for v in (c.tolist() if hasattr(c, "tolist") else c)] for k, c in table.items()
        }
    if isinstance(table, list):
        return [{_clean_text(str(k)): _clean_text(v) for k, v in row.items()} for row in table]
    if type(table).__name__ == "DataFrame":
        return _replace_invalid_text(table.to_dict(orient="list"))
    return table


def _plain_columns(table: pa.Table) -> pa.Table:
    """Dictionary-encoded (pandas categorical) columns become their values, so a column stays one type from
    call to call; bytes cells become text (invalid UTF-8 sequences replaced by U+FFFD): every tracker takes text."""
    for i, field in enumerate(table.schema):
        if pa.types.is_dictionary(field.type):
            table = table.set_column(i, field.name, table.column(i).cast(field.type.value_type))
            field = table.schema.field(i)
        if pa.types.is_binary(field.type) or pa.types.is_large_binary(field.type):
            text = [None if v is None else v.decode("utf-8", "replace") for v in table.column(i).to_pylist()]
            table = table.set_column(i, field.name, pa.array(text, pa.string()))
    return table


# -- one table name, call after call -----------------------------------------------------------------
PROMOTION_RULE = (
    "a column may change type between calls only as Arrow's permissive promotion allows (int -> float, a "
    "narrower int or float -> a wider one, null -> any type, string -> large_string, fields added to a struct); "
    "columns may appear and disappear"
)


class TableSchemas:
    """The columns of each table name so far: what a run checks every ``log_table`` against, so that
    every table it accepts can be stored with the earlier ones of that name (parquet concatenates a
    table's parts with Arrow's permissive promotion).

    Example:
        >>> schemas = TableSchemas()
        >>> schemas.check("t", pa.table({"a": [1]})).num_rows
        1
        >>> schemas.check("t", pa.table({"a": [0.5], "b": ["new"]})).num_rows  # int -> float, a new column
        1
        >>> schemas.check("t", pa.table({"a": ["text"]}))
        Traceback (most recent call last):
        rllog.errors.InvalidTable: table 't': column 'a' was double in earlier calls and is string now; ...
    """

    def __init__(self) -> None:
        self._schemas: dict[str, pa.Schema] = {}
        # Extremes of the 64-bit integer columns seen: promoting them (int64 -> double, uint64 -> int64)
        # fails on values the new type cannot hold exactly, and parquet would meet that only when writing.
        self._extremes: dict[str, dict[str, tuple[int, int]]] = {}
        self._lock = threading.Lock()

    def check(self, name: str, table: pa.Table) -> pa.Table:
        """``table``, once it is known that it can be stored with the earlier tables called ``name``.

        Raises:
            InvalidTable: a column type parquet cannot write or read back (a struct with no field, an
                interval, a union...), or a column whose type changed in a way :data:`PROMOTION_RULE`
                does not allow; the message names the column and both types.
        """
        extremes = _wide_int_extremes(table)
        with self._lock:
            known = self._schemas.get(name)
            if known is not None and table.schema.equals(known):  # the common case: the columns of last time
                self._extremes[name] = _merge_extremes(known, self._extremes[name], extremes)
                return table
            schema = table.schema.remove_metadata()
            merged = schema if known is None else _promote(name, known, schema)
            seen = self._extremes.get(name, {})
            if known is not None:
                _check_exact(name, known, merged, seen)
            _check_exact(name, schema, merged, extremes)
            check_parquet_types(name, merged)
            self._schemas[name] = merged
            self._extremes[name] = _merge_extremes(merged, seen, extremes)
        return table


def _promote(name: str, known: pa.Schema, schema: pa.Schema) -> pa.Schema:
    try:
        return pa.unify_schemas([known, schema], promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        pass
    clashes = []
    for field in schema:
        if field.name in known.names:
            before = known.field(field.name)
            try:
                pa.unify_schemas([pa.schema([before]), pa.schema([field])], promote_options="permissive")
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
                clashes.append(f"column {field.name!r} was {before.type} in earlier calls and is {field.type} now")
    detail = "; ".join(clashes) or f"its columns {schema} do not merge with the earlier {known}"
    raise InvalidTable(f"table {name!r}: {detail}; {PROMOTION_RULE}. Cast the column, or log it under a new column or table name")


def _is_wide_int(type_: pa.DataType) -> bool:
    return pa.types.is_int64(type_) or pa.types.is_uint64(type_)


SMALL_COLUMN_ROWS = 256  # up to this many rows an int column's extremes are taken in Python (cheaper than pc.min_max)


def _wide_int_extremes(table: pa.Table) -> dict[str, tuple[int, int]]:
    """``{column: (min, max)}`` of the table's non-empty int64/uint64 columns (narrower ints fit any promotion)."""
    extremes = {}
    for field, column in zip(table.schema, table.columns, strict=True):
        if not _is_wide_int(field.type):
            continue
        if len(column) <= SMALL_COLUMN_ROWS:  # a completions table: ~5 us a column against ~70
            values = [v for v in column.to_pylist() if v is not None]
            if values:
                extremes[field.name] = (min(values), max(values))
            continue
        import pyarrow.compute as pc

        low_high = pc.min_max(column).as_py()
        if low_high["min"] is not None:
            extremes[field.name] = (low_high["min"], low_high["max"])
    return extremes


def _merge_extremes(schema: pa.Schema, *extremes: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """The extremes of ``schema``'s columns that are still 64-bit ints, over every mapping given."""
    merged: dict[str, tuple[int, int]] = {}
    for mapping in extremes:
        for column, (low, high) in mapping.items():
            index = schema.get_field_index(column)
            if index >= 0 and _is_wide_int(schema.field(index).type):
                old_low, old_high = merged.get(column, (low, high))
                merged[column] = (min(low, old_low), max(high, old_high))
    return merged


def _check_exact(name: str, source: pa.Schema, merged: pa.Schema, extremes: dict[str, tuple[int, int]]) -> None:
    """Raise when the values logged as ``source`` could not be cast exactly to the promoted ``merged`` type."""
    for column, (low, high) in extremes.items():
        before, after = source.field(column).type, merged.field(column).type
        if before == after:
            continue
        try:
            pa.array([low, high], before).cast(after)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise InvalidTable(
                f"table {name!r}: column {column!r} holds {before} values from {low} to {high}, which {after} "
                f"(its type once promoted with the other calls' tables) cannot hold exactly ({exc}); {PROMOTION_RULE}. "
                "Log the column as text, or under a new column name"
            ) from None


def check_parquet_types(name: str, schema: pa.Schema) -> None:
    """Raise unless parquet can write a table of ``schema`` and read it back (checked once per schema).

    Raises:
        InvalidTable: naming each column whose type parquet refuses.
    """
    if _parquet_refusal(schema.remove_metadata()) is None:
        return
    refused = [(field, _parquet_refusal(pa.schema([field]))) for field in schema]
    detail = "; ".join(f"column {field.name!r} of type {field.type}: {why}" for field, why in refused if why)
    detail = detail or str(_parquet_refusal(schema))  # only the columns together are refused
    raise InvalidTable(
        f"table {name!r} has a column type parquet cannot store ({detail}); convert the column, e.g. to text "
        "(a struct column needs at least one field: not [{}, {}])"
    )


@functools.lru_cache(maxsize=256)
def _parquet_refusal(schema: pa.Schema) -> str | None:
    """Why parquet cannot write a table of ``schema`` and read it back, or None."""
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    try:
        pq.write_table(schema.empty_table(), sink)
        pq.read_table(pa.BufferReader(sink.getvalue()))
    except (pa.ArrowException, ValueError, TypeError, OSError) as exc:  # OSError: a struct nested past what it reads back
        return f"{type(exc).__name__}: {exc}"
    return None


# -- secrets ----------------------------------------------------------------------------------------
# The rule is documented in docs/decisions.md ("Secrets"); tests/test_secrets.py holds every spelling.
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")  # "apiKey" -> api, Key; "HFToken" -> HF, Token; "api-keys" -> api, keys
# Named anywhere in a key (compared without case or separators), these are credentials.
_CREDENTIAL_STEM = re.compile(
    r"password|passwd|passphrase|secret|credential|authorization|cookie|webhook|apikey|privatekey|accesskey|authheader"
)
# "<qualifier> key(s)" ends the name of a credential; a bare "key" (a metric's key, a dataset key) is not one.
_KEY_QUALIFIERS = frozenset(
    "api private secret access signing encryption ssh client session master license hmac account service "
    "deploy gpg pgp auth".split()
)
# A key ending in "token" names a credential unless the word before it names a tokenizer's vocabulary token.
_VOCABULARY_TOKENS = frozenset(
    "pad eos bos unk sep cls mask image video audio vision boi eoi boa eoa start end stop eot eom eod think "
    "placeholder special sentinel prefix suffix middle turn tool answer system".split()
)
# "tokens" (plural) counts tokens (max_new_tokens, num_tokens) unless one of these qualifies it.
_TOKEN_QUALIFIERS = frozenset(
    "access refresh auth hub hf bearer session id api oauth github gh gitlab slack bot personal security secret csrf jwt".split()
)
_CREDENTIAL_WORDS = frozenset(("auth", "dsn", "jwt"))  # as the last word: `auth`, `http_auth`, `sentry_dsn`


@functools.lru_cache(maxsize=4096)
def is_secret_key(key: str) -> bool:
    """Whether a config key names a credential: ``api-key``, ``apiKey``, ``hub_token``, ``headers/Authorization``...

    Ordinary names holding "token" are not: ``pad_token``, ``eos_token``, ``pad_token_id``, ``max_new_tokens``,
    ``include_num_input_tokens_seen``, ``tokenizer_name``.
    """
    words = [w.lower() for w in _WORD.findall(str(key))]
    if not words:
        return False
    if _CREDENTIAL_STEM.search("".join(words)):
        return True
    while len(words) > 1 and words[-1].isdigit():  # api_token_2
        words.pop()
    last, before = words[-1], (words[-2] if len(words) > 1 else "")
    if last in ("key", "keys"):
        return before in _KEY_QUALIFIERS
    if last.endswith("tokens"):
        return (last[:-6] or before) in _TOKEN_QUALIFIERS
    if last.endswith("token"):  # hub_token, hubToken, hubtoken, token
        return (last[:-5] or before) not in _VOCABULARY_TOKENS
    return last in _CREDENTIAL_WORDS


_TOKEN_SHAPES = (
    r"hf_[A-Za-z0-9]{30,}",  # Hugging Face user and organisation tokens
    r"api_org_[A-Za-z0-9]{30,}",
    r"sk-[A-Za-z0-9_\-]{20,}",  # OpenAI, Anthropic (sk-ant-...)
    r"gh[pousr]_[A-Za-z0-9]{30,}",  # GitHub, GitLab
    r"github_pat_[A-Za-z0-9_]{30,}",
    r"glpat-[A-Za-z0-9_\-]{20,}",
    r"xox[abposr]-[A-Za-z0-9\-]{10,}",  # Slack
    r"(?:AKIA|ASIA)[0-9A-Z]{16}",  # AWS access key id
    r"AIza[0-9A-Za-z_\-]{35}",  # Google API key
    r"[rs]k_(?:live|test)_[A-Za-z0-9]{16,}",  # Stripe
    r"npm_[A-Za-z0-9]{36}",
    r"pypi-[A-Za-z0-9_\-]{50,}",
    r"eyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}",  # a JWT
)
_TOKEN_SHAPE = re.compile(r"(?<![A-Za-z0-9])(?:" + "|".join(_TOKEN_SHAPES) + ")")
_PRIVATE_KEY_BLOCK = re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)", re.DOTALL)
_URL_PASSWORD = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s/@:]*:)[^\s/@]+(?=@)")  # keeps scheme://user: and @host
_AUTH_SCHEME = re.compile(r"\b(Bearer|Basic)(\s+)([A-Za-z0-9\-._~+/]+=*)", re.IGNORECASE)
# name=value (URL queries, connection strings, reprs), --name value (command lines), "name": value (JSON, dict reprs)
_NAME_EQUALS = re.compile(r"""(?<![\w.\-])(-{0,2}[A-Za-z_][\w.\-]*)(\s*=\s*)("[^"]*"|'[^']*'|[^\s&;,)\]}'"]+)""")
_DASHED_OPTION = re.compile(r"(?<!\S)(--?[A-Za-z][\w.\-]*)(\s+)([^\s\-'\"][^\s'\"]*)")
_QUOTED_ITEM = re.compile(r"""(["'])([^"'\n]{1,200})\1(\s*:\s*)("(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|\[[^\]]*\]|-?\d[\w.+\-]*)""")


def _named_value(match: re.Match) -> str:
    name, between, value = match.group(1), match.group(2), match.group(3)
    if not is_secret_key(name.lstrip("-")):
        return match.group(0)
    quote = value[0] if value[0] in "'\"" and value[-1] == value[0] and len(value) > 1 else ""
    return f"{name}{between}{quote}{REDACTED}{quote}"


def _quoted_item(match: re.Match) -> str:
    quote, name, between, value = match.groups()
    if not is_secret_key(name):
        return match.group(0)
    around = value[0] if value[0] in "'\"" else quote  # a list or a number becomes a quoted string (JSON stays JSON)
    return f"{quote}{name}{quote}{between}{around}{REDACTED}{around}"


def _auth_scheme(match: re.Match) -> str:
    scheme, space, credential = match.groups()
    if scheme.lower() == "basic":  # base64 of "user:password"; "Basic training" is not one
        try:
            secret = b":" in base64.b64decode(credential, validate=True)
        except (binascii.Error, ValueError):
            secret = False
    else:  # "bearer of" / "Bearer authentication" in prose is not a credential
        secret = len(credential) >= 8 and not (credential.isalpha() and credential.islower())
    return f"{scheme}{space}{REDACTED}" if secret else match.group(0)


def redact_text(text: str) -> str:
    """``text`` with the credentials inside it replaced by ``***REDACTED***``: a URL's password
    (``https://user:***REDACTED***@host``), ``Bearer``/``Basic`` credentials, well-known token shapes
    (``hf_...``, ``sk-...``, ``ghp_...``, ``xoxb-...``, AWS and Google keys, JWTs, PEM private keys), and the
    value of ``name=value``, ``--name value`` and ``"name": value`` where ``name`` names a credential.
    """
    text = _PRIVATE_KEY_BLOCK.sub(REDACTED, text)
    text = _URL_PASSWORD.sub(lambda match: match.group(1) + REDACTED, text)
    text = _TOKEN_SHAPE.sub(REDACTED, text)
    text = _AUTH_SCHEME.sub(_auth_scheme, text)
    text = _NAME_EQUALS.sub(_named_value, text)
    text = _DASHED_OPTION.sub(_named_value, text)
    return _QUOTED_ITEM.sub(_quoted_item, text)


def redact_args(args: Sequence[str]) -> tuple[str, ...]:
    """Command-line arguments with credentials replaced: :func:`redact_text` on each, and the argument after an
    option that names a credential (``--hub_token VALUE``: two arguments, which :func:`redact_text` sees apart)."""
    out = [redact_text(str(a)) for a in args]
    for i in range(len(out) - 1):
        option = str(args[i])
        if (
            option.startswith("-")
            and "=" not in option
            and is_secret_key(option.lstrip("-"))
            and not str(args[i + 1]).startswith("-")
        ):
            out[i + 1] = REDACTED
    return tuple(out)


def _keeps_no_secret(value: Any) -> bool:
    """None, booleans (``use_auth_token=True``) and empty values hold no secret: kept even under a secret key."""
    return value is None or isinstance(value, bool) or (isinstance(value, (str, bytes, Mapping, list, tuple, set)) and not value)


def _as_mapping(config: Any) -> Mapping | None:
    """A config object's fields: a dataclass, a pydantic model or anything with ``to_dict()``; else None.

    Raises:
        InvalidValue: converting it recursed without end (``asdict`` of a dataclass that holds itself).
    """
    if isinstance(config, Mapping):
        return config
    try:
        if hasattr(config, "to_dict") and not isinstance(config, type):
            return config.to_dict()
        if dataclasses.is_dataclass(config) and not isinstance(config, type):
            return dataclasses.asdict(config)
        if hasattr(config, "model_dump") and not isinstance(config, type):  # pydantic (wandb.Settings)
            return config.model_dump()
    except RecursionError:
        raise InvalidValue(
            f"a {type(config).__name__} cannot be turned into a dict: it nests too deep or contains itself"
        ) from None
    return None


def redact(value: Any) -> Any:
    """A JSON-friendly deep copy of ``value`` (e.g. ``backend_options``) with every credential replaced by
    ``***REDACTED***``: the whole value under a key that names a credential (:func:`is_secret_key`; None,
    booleans and empty values are kept), and credentials inside any string (:func:`redact_text`).

    Mappings (and dataclasses, pydantic models, objects with ``to_dict()``) become dicts, sequences lists,
    bytes text; numbers and None are kept; other objects become their redacted ``str()``.

    Example:
        >>> redact({"wandb": {"settings": {"api_key": "k" * 40}, "project": "p"}})
        {'wandb': {'settings': {'api_key': '***REDACTED***'}, 'project': 'p'}}

    Raises:
        InvalidValue: ``value`` nests more than :data:`MAX_NESTING_DEPTH` levels, or contains itself.
    """
    return _redact(value, "", 1)


def _redact(value: Any, path: str, depth: int) -> Any:
    """:func:`redact` of ``value``, found at key path ``path`` (``a/b[0]``), ``depth`` levels down."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, (bytes, bytearray)):
        return redact_text(bytes(value).decode("utf-8", "replace"))
    if depth > MAX_NESTING_DEPTH:
        raise InvalidValue(_too_deep(f"the value at {path!r}", value))
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_redact(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value)]
    mapping = _as_mapping(value)
    if mapping is not None:
        return {
            str(k): (v if _keeps_no_secret(v) else REDACTED)
            if is_secret_key(str(k))
            else _redact(v, f"{path}/{k}" if path else str(k), depth + 1)
            for k, v in mapping.items()
        }
    return redact_text(str(value))


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
