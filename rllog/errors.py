"""Every exception rllog raises on purpose.

User-facing errors (bad values, bad tables, unknown backends) derive from :class:`RllogError`.
Sinks raise :class:`RateLimited` or :class:`TransientError` for what is worth retrying; the delivery
layer treats any other exception from a sink as permanent for that sink.
"""

from __future__ import annotations


class RllogError(Exception):
    """Base class of every error rllog raises on purpose."""


class InvalidValue(RllogError, ValueError):
    """A metric value that is not a real scalar (a string, a list, None, a multi-element tensor...)."""


class InvalidKey(RllogError, ValueError):
    """A metric or table name that is not a non-empty string."""


class InvalidStep(RllogError, ValueError):
    """A step that is not a non-negative integer."""


class InvalidTable(RllogError, ValueError):
    """A table that cannot be turned into columns of equal length."""


class RunFinished(RllogError, RuntimeError):
    """``log``/``log_table`` called on a run that has already finished."""


class RunDirError(RllogError, OSError):
    """The run directory cannot be created or written."""


class UnknownBackend(RllogError, ValueError):
    """A ``report_to`` name that is neither built in nor registered through an entry point."""


class BackendNotInstalled(RllogError, ImportError):
    """A known backend whose tracker package is not installed."""


class InvalidSink(RllogError, TypeError):
    """An object in ``report_to`` that does not implement the :class:`rllog.sink.MetricSink` protocol."""


class SinkBusy(RllogError, RuntimeError):
    """Another process already delivers this run to this sink (its cursor lock is held)."""


class DeliveryError(RllogError):
    """Base of the errors a sink raises to ask for a retry."""


class TransientError(DeliveryError):
    """A failure worth retrying (connection reset, HTTP 5xx...). Retried with capped exponential backoff."""


class RateLimited(TransientError):
    """The tracker asked us to slow down (HTTP 429). ``retry_after`` is in seconds, or None if not given."""

    def __init__(self, retry_after: float | None = None, message: str = "rate limited"):
        super().__init__(f"{message} (retry after {retry_after}s)" if retry_after is not None else message)
        self.retry_after = retry_after


class InvalidArgument(RllogError, ValueError):
    """An argument of ``rllog.init`` (or another rllog call) outside what it accepts, e.g. ``flush_interval=0``."""


class UnknownArgument(RllogError, TypeError):
    """A keyword argument ``rllog.init`` does not take (the message names those it does, and the closest one)."""


class InvalidSetting(RllogError, ValueError):
    """An ``RLLOG_*`` environment variable whose value rllog cannot use (see :mod:`rllog.settings`)."""


class ForkedChild(RllogError, RuntimeError):
    """``log``/``log_table``/``finish`` called in a process forked from the one that started the run.

    A forked child (a DataLoader or multiprocessing worker, a reward worker) shares no writer thread
    with the run: return the values to the parent process and log them there.
    """


class NothingToPlot(RllogError, ValueError):
    """``rllog plot`` (``rllog.plot.plot_run``) on a run that has no metrics to plot."""
