"""The ``MetricSink`` protocol: what a tracker backend implements.

A sink translates rllog records into one tracker's calls, and nothing else: it knows nothing of
processes, threads, queues, retries, ranks or the journal. The delivery layer
(:mod:`rllog.delivery`) calls it from one thread, in this order::

    open(run_info) -> [write_metrics(batch), write_table(record) ..., write_alert(record) ...] ... -> [flush()] ... -> close(status)

Per batch read from the journal, its metric records come in one ``write_metrics`` call, then its tables and
alerts; each kind in ``seq`` order. Place data by ``record.step``, never by arrival order.

A sink raises :class:`rllog.errors.RateLimited` (with ``retry_after`` when the tracker says) or
:class:`rllog.errors.TransientError` for failures worth retrying; the same call is then repeated with
the records it had not taken. A sink never tracks what it was sent: the delivery layer hands it no record twice
while it runs. A ``write_metrics`` that stores its batch in several tracker calls says after each how far it got
(:func:`took`), so that a call raising halfway is repeated with the rest only; without that, with the whole batch.
Any other exception marks the sink failed; its records stay in the journal for ``rllog replay``.

Example:
    >>> class PrintSink:
    ...     capabilities = Capabilities(tables=False)
    ...     def open(self, run_info): pass
    ...     def write_metrics(self, records):
    ...         for r in records:
    ...             print(r.step, dict(r.values))
    ...     def close(self, status): pass
    >>> isinstance(PrintSink(), MetricSink)
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from rllog.records import MetricsRecord, RunInfo
from rllog.settings import CONSOLE_FD

CONSOLE_FD_ENV = CONSOLE_FD.name  # the trainer's stdout, duplicated by the agent, for a sink that draws on the terminal


@dataclass(frozen=True)
class Capabilities:
    """What a sink can take besides scalar metrics.

    Attributes:
        tables: ``write_table`` stores tables (otherwise table records are acknowledged and skipped).
        config: ``open`` records ``run_info.config`` as the run's hyperparameters.
        alerts: the sink shows health alerts.
        durable_writes: ``write_*`` returns only once the data cannot be lost (a synchronous database
            write). When False (the safe default) the delivery layer treats what a sink accepted as
            in flight until its ``flush()`` returned, and only then moves the sink's cursor past it.
    """

    tables: bool = True
    config: bool = True
    alerts: bool = False
    durable_writes: bool = False


@runtime_checkable
class MetricSink(Protocol):
    """A delivery target for one tracker: ``capabilities``, ``open``, ``write_metrics`` and ``close``.

    The other members are optional, and what a sink takes is said one way, by ``capabilities``:
    ``write_table(record: TableRecord)`` when ``capabilities.tables``, ``write_alert(record: AlertRecord)``
    when ``capabilities.alerts``, ``write_config(record: ConfigRecord)`` (config given after ``open``,
    ``Run.update_config``) when ``capabilities.config``. ``flush()`` may be left out (a sink that writes
    through has nothing to flush; delivery then treats its writes as flushed when they return).
    ``check_table(name, table)``, a static or class method, says what the store can hold: the run calls it in the
    trainer at ``log_table`` for the selected sinks only, and it raises :class:`rllog.errors.InvalidTable` for a
    table the store cannot take (cheap, no tracker import).
    docs/sink-protocol.md has the whole contract.
    """

    capabilities: Capabilities

    def open(self, run_info: RunInfo) -> None:
        """Start (or resume, using ``run_info.run_id``) the tracker's run and record the config."""

    def write_metrics(self, records: Sequence[MetricsRecord]) -> None:
        """Write a batch of metric records, in sequence order."""

    def close(self, status: str) -> None:
        """End the tracker's run with ``status``: ``finished``, ``failed`` or ``killed``. Flushes first."""


class Batch(list):
    """The records of one ``write_metrics`` call, as the delivery layer hands them over; ``taken_seq``: the sink has
    stored every record up to it (:func:`took`)."""

    taken_seq = 0

    def drop_taken(self) -> list:
        """Remove the records the sink has taken (what a repeated call must not hand it again); returns them."""
        taken = [r for r in self if r.seq <= self.taken_seq]
        if taken:
            self[:] = [r for r in self if r.seq > self.taken_seq]
        return taken


def took(records: Sequence[MetricsRecord], seq: int) -> None:
    """Say that every record of ``records`` up to ``seq`` is stored (a tracker call for them returned): if the sink's
    call raises later, it is repeated with the records after ``seq`` only. Nothing for a plain sequence (a direct call).

    Example:
        >>> def write_metrics(self, records):
        ...     for step, row, last_seq in step_rows(records):
        ...         self.tracker.log(row, step=step)
        ...         took(records, last_seq)
    """
    if isinstance(records, Batch):
        records.taken_seq = max(records.taken_seq, seq)


def sink_problem(sink: object) -> str | None:
    """Why ``sink`` cannot be delivered to (None when it can): a missing member, or a capability without its method.

    ``sink`` is a sink object or a sink class (an entry point's, checked at ``init`` before the agent builds it;
    capabilities computed by a property are checked once the sink is built)."""
    name = sink.__name__ if isinstance(sink, type) else type(sink).__name__
    if not isinstance(sink, MetricSink):
        missing = [m for m in ("capabilities", "open", "write_metrics", "close") if not hasattr(sink, m)]
        return f"{name} does not implement MetricSink (missing {', '.join(missing)})"
    caps = sink.capabilities
    for flag, method in (("tables", "write_table"), ("alerts", "write_alert")):
        if getattr(caps, flag, False) is True and not callable(getattr(sink, method, None)):
            return f"{name} declares capabilities.{flag} but has no {method}()"
    return None
