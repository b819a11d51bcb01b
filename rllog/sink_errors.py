"""Helpers for sinks: turn a tracker's exceptions into rllog's retry errors.

The delivery layer retries a call that raised :class:`rllog.errors.RateLimited` or
:class:`rllog.errors.TransientError` and treats anything else as permanent. A sink wraps its tracker
calls in :func:`map_errors`, which decides by the exception and everything it wraps:

- a full disk or quota (``ENOSPC``, ``EDQUOT``, SQLite's ``SQLITE_FULL`` and the write errors a full
  disk causes) -> ``TransientError``: the call is repeated until space returns, nothing is dropped;
- what the sink's own ``classify`` says (a tracker's error codes);
- an HTTP 429 -> ``RateLimited``, with the seconds of a ``Retry-After`` header when a response says;
- an HTTP 5xx or 408 -> ``TransientError``; any other HTTP status -> unchanged (permanent);
- an exception of a type the sink names as ``permanent`` -> unchanged;
- a connection error or timeout (Python's own, and those of ``requests``, ``urllib3`` and ``httpx``),
  or a type the sink names as ``transient`` -> ``TransientError``;
- anything else -> unchanged.

What is particular to one tracker (its exception types, a status written only in its messages, its
own header names, a special error code) stays in that sink and is passed in. This module imports no
tracker and no HTTP client.

Example:
    >>> from rllog.sink_errors import map_errors
    >>> class MySink:
    ...     def write_metrics(self, records):
    ...         with map_errors("mytracker"):
    ...             self.client.log_many(records)       # a 503 here is retried, a 400 is not
"""

from __future__ import annotations

import email.utils
import errno
import os
import re
import sqlite3
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from rllog.errors import RateLimited, TransientError

DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})
#: SQLite's result codes for a full disk: its own, and the write errors a full disk causes without
#: saying so (SQLite does not pass the OS's errno on; a WAL database on a full tmpfs fails to grow its
#: shared-memory file with SQLITE_IOERR_SHMSIZE).
SQLITE_DISK_FULL = frozenset(
    getattr(sqlite3, name, code)
    for name, code in (("SQLITE_FULL", 13), ("SQLITE_IOERR_WRITE", 778), ("SQLITE_IOERR_SHMSIZE", 4874))
)
SQLITE_FULL_MESSAGE = "database or disk is full"  # SQLITE_FULL's text: Python < 3.11 has no sqlite_errorcode
RETRY_AFTER = ("Retry-After",)
#: The text urllib3's ``Retry`` leaves once its retries are used up ("too many 429 error responses"):
#: the status, without the response.
URLLIB3_RETRIES = re.compile(r"too many (\d{3}) error responses")
#: Exception types of the common HTTP clients that mean "could not reach / no answer in time", by
#: module; looked up only in modules already imported (an exception of a module never imported cannot occur).
NETWORK_ERRORS = {
    "requests.exceptions": ("ConnectionError", "Timeout", "ChunkedEncodingError"),
    "urllib3.exceptions": ("ProtocolError", "NewConnectionError", "TimeoutError"),
    "httpx": ("NetworkError", "TimeoutException", "RemoteProtocolError"),
}


def exception_chain(exc: BaseException, wrapped: Sequence[str] = ()) -> list[BaseException]:
    """``exc`` and every exception it wraps, nearest first, each once.

    Follows ``__cause__`` and ``__context__``, and the attributes named in ``wrapped`` (a tracker's own
    wrapper, e.g. ``("exc",)`` for wandb's ``CommError``).
    """
    chain: list[BaseException] = []
    pending: list[Any] = [exc]
    while pending:
        current = pending.pop(0)
        if isinstance(current, BaseException) and all(current is not seen for seen in chain):
            chain.append(current)
            pending.extend(getattr(current, name, None) for name in wrapped)
            pending.extend((current.__cause__, current.__context__))
    return chain


def _status_of(obj: Any, names: Sequence[str] = ("status_code", "status")) -> int | None:
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
            return value
    return None


def http_status(
    exc: BaseException, patterns: Sequence[re.Pattern[str]] = (URLLIB3_RETRIES,), wrapped: Sequence[str] = ()
) -> tuple[int | None, Any]:
    """``(status, response)`` of the HTTP failure behind ``exc``, or ``(None, None)``.

    A ``response`` (with ``status_code`` or ``status``) anywhere in the chain wins, or an exception's
    own ``status_code``; then the first of ``patterns`` whose group 1 matches an exception's
    message (the response is then None).
    """
    chain = exception_chain(exc, wrapped)
    for e in chain:
        response = getattr(e, "response", None)
        status = _status_of(response)
        if status is not None:
            return status, response
        status = _status_of(e, ("status_code",))
        if status is not None:
            return status, None
    for e in chain:
        for pattern in patterns:
            match = pattern.search(str(e))
            if match:
                return int(match.group(1)), None
    return None, None


def parse_retry_after(value: str | float | int | None, now: float | None = None) -> float | None:
    """Seconds to wait from an HTTP ``Retry-After`` value (delta-seconds or an HTTP-date), or None.

    Example:
        >>> parse_retry_after("120")
        120.0
        >>> parse_retry_after("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412480.0)
        10.0
    """
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return max(0.0, float(value))
    text = str(value).strip()
    try:
        return max(0.0, float(text))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def _header(headers: Any, name: str) -> Any:
    try:
        value = headers.get(name)
    except Exception:
        return None
    if value is None and isinstance(headers, Mapping):  # a plain dict is case-sensitive; HTTP is not
        value = next((v for k, v in headers.items() if str(k).lower() == name.lower()), None)
    return value


def retry_after(
    source: Any, headers: Sequence[str] = RETRY_AFTER, now: float | None = None, wrapped: Sequence[str] = ()
) -> float | None:
    """Seconds from the first parsable of ``headers`` on a response: ``source`` itself, or the
    ``response`` of an exception in ``source``'s chain. None when no response says."""
    if isinstance(source, BaseException):
        responses = [getattr(e, "response", None) for e in exception_chain(source, wrapped)]
    else:
        responses = [source]
    for response in responses:
        found = getattr(response, "headers", None)
        if not found:
            continue
        for name in headers:
            seconds = parse_retry_after(_header(found, name), now)
            if seconds is not None:
                return seconds
    return None


def is_disk_full(exc: BaseException, wrapped: Sequence[str] = ()) -> bool:
    """Whether a full disk or an exhausted quota is anywhere in ``exc``'s chain.

    An ``OSError`` with ``ENOSPC``/``EDQUOT``, or a SQLite error in :data:`SQLITE_DISK_FULL`
    (``SQLITE_FULL``, "database or disk is full"; and the write errors a full disk causes).
    """
    for e in exception_chain(exc, wrapped):
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return True
        if isinstance(e, sqlite3.Error):
            code = getattr(e, "sqlite_errorcode", None)
            if code in SQLITE_DISK_FULL or (code is None and SQLITE_FULL_MESSAGE in str(e)):
                return True
    return False


#: What the local machine ran out of, not what a call got wrong: descriptors (per process, system-wide), memory,
#: disk space and quota, and a resource that is busy for now. A call that raised one of these may work once
#: the resource comes back (another thread closes a file, memory is freed, space returns).
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.ENOBUFS, *DISK_FULL_ERRNOS})


#: How the dynamic loader says it ran out of one of those: an extension module whose ``dlopen`` failed raises a bare
#: ``ImportError`` with only the loader's text ("...: cannot open shared object file: Too many open files"). Out of
#: address space (``RLIMIT_AS``), glibc's loader names no errno: "...: failed to map segment from shared object". A
#: filesystem mounted ``noexec`` gets the same words for good; such a sink then waits (pending, its cause named)
#: rather than failing, and its records stay in the journal either way.
RESOURCE_MESSAGES = (*(os.strerror(e) for e in sorted(RESOURCE_ERRNOS)), "failed to map segment from shared object")


def is_resource_exhausted(exc: BaseException, wrapped: Sequence[str] = ()) -> bool:
    """Whether the local machine ran out of something anywhere in ``exc``'s chain: a ``MemoryError``, an
    ``OSError`` in :data:`RESOURCE_ERRNOS`, an ``ImportError`` whose loader said so (:data:`RESOURCE_MESSAGES`), or a
    full disk as :func:`is_disk_full` sees it."""
    chain = exception_chain(exc, wrapped)
    for e in chain:
        if isinstance(e, MemoryError) or (isinstance(e, OSError) and e.errno in RESOURCE_ERRNOS):
            return True
        if isinstance(e, ImportError) and any(message in str(e) for message in RESOURCE_MESSAGES):
            return True
    return is_disk_full(exc, wrapped)


def network_errors() -> tuple[type[BaseException], ...]:
    """Python's connection errors and timeouts, and those of the HTTP clients already imported."""
    found: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module_name, names in NETWORK_ERRORS.items():
        module = sys.modules.get(module_name)
        found.extend(t for t in (getattr(module, n, None) for n in names) if isinstance(t, type) and issubclass(t, BaseException))
    return tuple(found)


def retry_error(
    exc: BaseException,
    tracker: str = "",
    *,
    transient: tuple[type[BaseException], ...] = (),
    permanent: tuple[type[BaseException], ...] = (),
    classify: Callable[[BaseException], TransientError | None] | None = None,
    status_patterns: Sequence[re.Pattern[str]] = (URLLIB3_RETRIES,),
    retry_after_headers: Sequence[str] = RETRY_AFTER,
    wrapped: Sequence[str] = (),
) -> TransientError | None:
    """The retry error for ``exc`` (the rules at the top of this module), or None when it is permanent.

    Args:
        exc: what the tracker raised.
        tracker: a name put in front of the message (``"wandb: HTTP 503: ..."``).
        transient: the tracker's own exception types worth a retry (anywhere in the chain).
        permanent: the tracker's own exception types never worth a retry (unless the disk is full), even
            if they are subclasses of a ``transient`` type (e.g. wandb's ``AuthenticationError``, a ``CommError``).
        classify: asked first after a full disk; a tracker's special cases (an error code, a message).
            Returns the error to raise, or None to go on with the rules.
        status_patterns: regexes finding an HTTP status in a message (group 1) when no response has one.
        retry_after_headers: response headers giving the wait of a 429, first parsable wins.
        wrapped: attribute names under which the tracker's exceptions keep the one they wrap.
    """
    if isinstance(exc, TransientError):
        return exc
    prefix = f"{tracker}: " if tracker else ""
    if is_disk_full(exc, wrapped):
        return TransientError(f"{prefix}disk full, retrying until there is room: {exc}")
    if classify is not None:
        special = classify(exc)
        if special is not None:
            return special
    status, response = http_status(exc, status_patterns, wrapped)
    if status == 429:
        seconds = (
            retry_after(response, retry_after_headers)
            if response is not None
            else retry_after(exc, retry_after_headers, wrapped=wrapped)
        )
        return RateLimited(seconds, message=f"{prefix}HTTP 429: {exc}")
    if status is not None:
        return TransientError(f"{prefix}HTTP {status}: {exc}") if status >= 500 or status == 408 else None
    chain = exception_chain(exc, wrapped)
    if permanent and any(isinstance(e, permanent) for e in chain):
        return None
    retryable = network_errors() + tuple(transient)
    if any(isinstance(e, retryable) for e in chain):
        return TransientError(f"{prefix}{type(exc).__name__}: {exc}")
    return None


@contextmanager
def map_errors(tracker: str = "", **rules: Any) -> Iterator[None]:
    """Re-raise what the block raises as rllog's retry errors where :func:`retry_error` says so.

    The original exception is the new one's ``__cause__``; an exception that is not worth a retry
    propagates unchanged. Keyword arguments are those of :func:`retry_error`.

    Example:
        >>> with map_errors("mlflow", classify=mlflow_codes):   # doctest: +SKIP
        ...     client.log_batch(run_id, metrics=chunk)
    """
    try:
        yield
    except TransientError:
        raise
    except Exception as exc:
        mapped = retry_error(exc, tracker, **rules)
        if mapped is None:
            raise
        raise mapped from exc
