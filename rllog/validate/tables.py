"""Tables as users pass them to ``log_table``, turned into Arrow tables every tracker can take; and the columns of
each table name kept consistent from call to call. What one store cannot hold (a Parquet type, a name too long for
a directory) is that sink's own ``check_table`` (:mod:`rllog.sink`), asked by the run for the selected sinks only."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from rllog.errors import InvalidKey, InvalidTable, InvalidValue
from rllog.validate.metrics import INT64_MAX
from rllog.validate.nesting import _children, check_nesting

RESERVED_TABLE_COLUMNS = ("_step", "_seq")


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


@dataclass(frozen=True)
class TableColumns:
    """A table logged as Python columns that :meth:`TableSchemas.repeat` found to be a repeat of the last accepted
    table of its name: ``columns`` (copies of the caller's lists) convert to ``schema``, checked already.

    It is journaled as JSON beside ``schema_ipc`` (the schema as an Arrow IPC message) on the journal writer's
    thread, and read back as ``pa.table(columns, schema=schema)``: the training thread never runs pyarrow for it.
    """

    columns: dict[str, list]
    schema: pa.Schema
    schema_ipc: bytes


@dataclass(frozen=True)
class _Shape:
    """The Python form of the last table a name accepted: column names, each column's cell types, the Arrow schema
    that table became (``schema``, as an IPC message in ``schema_ipc``), and the name's columns it was checked
    against (``merged``: a repeat is taken only while they are still the name's)."""

    names: tuple[str, ...]
    cell_types: tuple[frozenset[type], ...]
    schema: pa.Schema
    schema_ipc: bytes
    merged: pa.Schema


# The cells whose Arrow type follows from their Python types alone: an int column ({int}) needs its values in int64
# and text needs to be valid UTF-8 (both checked by TableSchemas.repeat); bytes are turned into text by
# _plain_columns, so a table with bytes always takes the full path.
_REPEATABLE_CELLS = frozenset((str, int, float, bool, type(None)))
_NONE = frozenset((type(None),))
# Larger tables take the full path: the writer thread encodes a repeat as JSON holding the GIL for the whole table,
# and the reader builds its Python objects before Arrow's; at this size that is ~1 ms, and the full path's cost is
# per cell rather than the fixed, cache-cold part the repeat path saves.
REPEAT_MAX_CELLS = 8192


def _python_shape(table: Any) -> tuple[tuple[str, ...], tuple[frozenset[type], ...]] | None:
    """``(names, cell types per column)`` of a dict of lists of flat cells that :meth:`TableSchemas.repeat` can
    take, else None. Each column holds one type besides None, and an int column nothing else: Arrow's type for
    such a column follows from that type (for ints, from their range too, which ``repeat`` checks)."""
    if type(table) is not dict or not table:
        return None
    names = tuple(table)
    if not all(type(name) is str for name in names):
        return None
    cell_types = []
    for cells in table.values():
        if type(cells) is not list:
            return None
        kinds = frozenset(map(type, cells))
        if not _REPEATABLE_CELLS.issuperset(kinds) or len(kinds - _NONE) > 1 or (int in kinds and len(kinds) > 1):
            return None
        cell_types.append(kinds)
    return names, tuple(cell_types)


def _valid_text(cells: list) -> bool:
    """Whether every text cell encodes as UTF-8 (a lone surrogate does not; the full path replaces it)."""
    text = "".join(filter(None, cells))
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class TableSchemas:
    """The columns of each table name so far: what a run checks every ``log_table`` against, so that
    every table it accepts can be stored with the earlier ones of that name (parquet concatenates a
    table's parts with Arrow's permissive promotion).

    A table logged every step has the columns of its last call: :meth:`repeat` recognises it from its Python
    types alone, so that only a table that differs from the last one of its name is converted on the caller's thread.

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
        self._shapes: dict[str, _Shape] = {}
        self._lock = threading.Lock()

    def repeat(self, name: str, table: Any) -> TableColumns | None:
        """``table`` (a dict of lists) as :class:`TableColumns` when its columns have the names and cell types of the
        last table :meth:`remember` kept for ``name``, and their values fit that table's Arrow types; else None (the
        caller converts it with :func:`to_arrow_table` and :meth:`check`). Accepting it records its int extremes as
        :meth:`check` does. The sinks' ``check_table`` decided on the same name and schema already.
        """
        shape = self._shapes.get(name) if type(name) is str else None
        if shape is None or type(table) is not dict or len(table) != len(shape.names):
            return None
        if not all(type(cells) is list for cells in table.values()):
            return None
        columns = {column: list(cells) for column, cells in table.items()}  # checked and kept: the caller may reuse its lists
        if _python_shape(columns) != (shape.names, shape.cell_types):
            return None
        rows = {len(cells) for cells in columns.values()}
        if len(rows) > 1 or rows.pop() * len(columns) > REPEAT_MAX_CELLS:
            return None  # ragged (to_arrow_table says how), or large
        extremes = {}
        for (column, cells), kinds in zip(columns.items(), shape.cell_types, strict=True):
            if int in kinds and cells:
                low, high = min(cells), max(cells)
                if low < -INT64_MAX - 1 or high > INT64_MAX:
                    return None
                extremes[column] = (low, high)
            elif str in kinds and not _valid_text(cells):
                return None
        with self._lock:
            if self._schemas.get(name) is not shape.merged:  # another table of this name changed its columns since
                return None
            self._extremes[name] = _merge_extremes(shape.merged, self._extremes[name], extremes)
        return TableColumns(columns, shape.schema, shape.schema_ipc)

    def remember(self, name: str, table: Any, arrow: pa.Table) -> None:
        """Keep the Python shape of ``table`` (as the caller passed it; ``arrow`` is what it became, every check
        passed) for :meth:`repeat`, when it is a dict of lists of flat cells with the columns ``name`` has now, under
        the names it gave them (a name that was not valid UTF-8 was replaced), its int columns int64 (the type
        ``repeat``'s range check is for)."""
        shape = _python_shape(table)
        with self._lock:
            known = self._schemas.get(name)
            if (
                shape is None
                or known is None
                or not arrow.schema.equals(known)
                or shape[0] != tuple(arrow.schema.names)
                or any(int in kinds and field.type != pa.int64() for kinds, field in zip(shape[1], arrow.schema, strict=True))
            ):
                self._shapes.pop(name, None)
                return
            old = self._shapes.get(name)
            if old is not None and old.merged is known and old.schema.equals(arrow.schema, check_metadata=True):
                schema, ipc = old.schema, old.schema_ipc
            else:
                schema, ipc = arrow.schema, arrow.schema.serialize().to_pybytes()
            self._shapes[name] = _Shape(*shape, schema, ipc, known)

    def check(self, name: str, table: pa.Table) -> pa.Table:
        """``table``, once it is known that it can be stored with the earlier tables called ``name``.

        Raises:
            InvalidTable: a column whose type changed in a way :data:`PROMOTION_RULE` does not allow; the
                message names the column and both types.
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
