"""What every rank's run object shares: validation, the collectives of a multi-process run, and the lifecycle."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from rllog import distributed
from rllog.rundir import FinishReport
from rllog.validate import TableSchemas, normalise_metrics, stack_scalars, to_arrow_table

log = logging.getLogger("rllog")


def _to_host(tensors: dict[str, Any]) -> dict[str, float]:
    """One-element tensors -> floats with one device-to-host copy."""
    if not tensors:
        return {}
    return dict(zip(tensors, stack_scalars(list(tensors.values())).tolist(), strict=True))


def _sink_classes(selected: list) -> list[Any]:
    """The class of each sink named in ``selected`` (no tracker is imported), and each sink object as it is."""
    from rllog import registry

    return [registry.resolve(item).load() if isinstance(item, str) else item for item in selected]


def takes_tables(selected: list) -> bool:
    """Whether any selected sink stores tables (checked from the sink classes; no tracker is imported)."""
    return any(getattr(getattr(cls, "capabilities", None), "tables", False) for cls in _sink_classes(selected))


def table_checks(selected: list) -> list[Callable[[str, Any], None]]:
    """The ``check_table`` of each selected sink that stores tables and declares one (rllog.sink)."""
    checks = []
    for cls in _sink_classes(selected):
        check = getattr(cls, "check_table", None)
        if callable(check) and getattr(getattr(cls, "capabilities", None), "tables", False):
            checks.append(check)
    return checks


class RunBase:
    """What every rank's run object shares: validation, the collectives of a multi-process run, and the lifecycle."""

    _distributed = False
    _takes_tables = True
    sink_names: list[str]
    _selected: list[Any] = []  # report_to parsed: sink names and sink objects
    _table_checks: list[Callable[[str, Any], None]] | None = None  # the selected sinks' check_table, once a table comes

    def __init__(self, reduce_across_ranks: bool | None) -> None:
        # None: reduce when torch.distributed is up. False: only this process logs (a trainer that
        # already reduced its metrics, like the HF/TRL integration, logs from the main process alone).
        self._distributed = distributed.is_distributed() if reduce_across_ranks is None else reduce_across_ranks
        if self._distributed:
            distributed.reset()  # every rank creates its run object: a new run forgets the old run's keys
        self._step = -1
        self._finished: FinishReport | None = None
        self._table_schemas = TableSchemas()  # a column's type may change between calls only as documented
        self._holders: list[Callable[[], None]] = []  # see before_flush

    def _prepare_metrics(self, values: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, Any]]:
        floats, tensors = normalise_metrics(values)
        if self._distributed:  # a collective: same call on every rank
            floats = distributed.reduce_metrics(floats | _to_host(tensors))
            tensors = {}
        return floats, tensors

    def _prepare_table(self, name: str, table: Any) -> Any:
        """``table`` checked for every selected store: a :class:`~rllog.validate.TableColumns` when it repeats the
        columns of the last table of its name (no Arrow work on this thread), else a ``pyarrow.Table``."""
        gathered = self._distributed and self._takes_tables
        if not gathered:
            repeated = self._table_schemas.repeat(name, table)
            if repeated is not None:
                return repeated
        arrow = to_arrow_table(name, table)
        if gathered:
            rows = distributed.gather_rows(arrow.to_pylist())
            arrow = to_arrow_table(name, rows) if rows is not None else None
        if arrow is None:
            return None
        arrow = self._table_schemas.check(name, arrow)
        if self._table_checks is None:
            self._table_checks = table_checks(self._selected)
        for check in self._table_checks:  # what each selected store can hold (a Parquet column type, ...)
            check(name, arrow)
        if not gathered:
            self._table_schemas.remember(name, table, arrow)
        return arrow

    @property
    def step(self) -> int:
        """The step of the last logged metrics (-1 before the first)."""
        return self._step

    @property
    def finished(self) -> bool:
        return self._finished is not None

    def finish(self, status: str = "finished", timeout: float = 120.0) -> FinishReport:
        raise NotImplementedError

    def before_flush(self, log_held: Callable[[], None]) -> None:
        """Call ``log_held`` at the start of every ``flush`` and ``finish`` (a SIGTERM's included), while the run
        still takes records: code that holds values back to log them together (the TRL integration holds a step's
        profiling timings) logs them there, so a flush waits for them and a finish never leaves them behind.

        Example:
            >>> held = {"time/generate": 0.4}  # values the caller's code holds back to log together
            >>> def log_held():
            ...     if held:
            ...         run.log(dict(held))
            ...         held.clear()
            >>> run.before_flush(log_held)
        """
        self._holders.append(log_held)

    def _log_held(self) -> None:
        for log_held in list(self._holders):
            try:
                log_held()
            except Exception as exc:  # what was held is reported; the flush or finish goes on
                log.error("rllog: logging held values before a flush or finish failed: %s", exc)

    def __enter__(self) -> RunBase:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.finish("failed" if exc_type is not None else "finished")
