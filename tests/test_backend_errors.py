"""rllog.sink_errors, the error mapping every backend shares: real faults where the machine can make them
(ENOSPC from /dev/full, SQLite's SQLITE_FULL from a page limit, a refused connection), real ``requests``
responses for HTTP statuses and headers."""

from __future__ import annotations

import ast
import errno
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from rllog.errors import RateLimited, TransientError
from rllog.sink_errors import exception_chain, http_status, is_disk_full, map_errors, parse_retry_after, retry_after, retry_error

ROOT = Path(__file__).resolve().parents[1]


def response(status: int, headers: dict | None = None) -> requests.Response:
    out = requests.Response()
    out.status_code = status
    out.headers.update(headers or {})
    return out


def http_error(status: int, headers: dict | None = None) -> requests.HTTPError:
    return requests.HTTPError(f"{status} error", response=response(status, headers))


def raised(exc: BaseException, **rules) -> BaseException:
    """What escapes ``map_errors`` when the block raises ``exc``."""
    try:
        with map_errors("tracker", **rules):
            raise exc
    except BaseException as out:
        return out
    raise AssertionError("nothing raised")


def disk_full_error() -> OSError:
    """A real ENOSPC: every write to /dev/full fails with it."""
    try:
        with open("/dev/full", "wb", buffering=0) as f:
            f.write(b"x")
    except OSError as exc:
        return exc
    raise AssertionError("/dev/full accepted a write")


def sqlite_full_error() -> sqlite3.Error:
    """A real SQLITE_FULL ("database or disk is full"): a database that may not grow past its pages."""
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE t (x BLOB)")
    conn.execute(f"PRAGMA max_page_count = {conn.execute('PRAGMA page_count').fetchone()[0] + 1}")
    try:
        conn.execute("INSERT INTO t VALUES (?)", (b"x" * 100_000,))
    except sqlite3.Error as exc:
        return exc
    finally:
        conn.close()
    raise AssertionError("sqlite grew past max_page_count")


def refused_connection() -> ConnectionRefusedError:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    port = server.getsockname()[1]
    server.close()
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5)
    except ConnectionRefusedError as exc:
        return exc
    raise AssertionError("a closed port accepted a connection")


def test_parse_retry_after():
    assert parse_retry_after("120") == 120.0
    assert parse_retry_after(" 2.5 ") == 2.5 and parse_retry_after(3) == 3.0 and parse_retry_after(-4) == 0.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412480.0) == pytest.approx(10.0)
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412500.0) == 0.0  # already past
    assert parse_retry_after("garbage") is None and parse_retry_after(None) is None and parse_retry_after("") is None


def test_retry_after_from_a_response_or_an_exception_chain():
    assert retry_after(response(429, {"retry-after": "7"})) == 7.0  # header names are case-insensitive
    assert retry_after(type("R", (), {"headers": {"retry-after": "3"}})()) == 3.0  # a plain dict too
    assert retry_after(response(429)) is None and retry_after(None) is None
    custom = response(429, {"Retry-After": "soon", "Retry-After-Custom": "2.5"})
    assert retry_after(custom) is None  # unparsable, and the tracker's own header not asked for
    assert retry_after(custom, headers=("Retry-After", "Retry-After-Custom")) == 2.5
    try:
        try:
            raise http_error(429, {"Retry-After": "9"})
        except requests.HTTPError as inner:
            raise RuntimeError("tracker wrapper") from inner
    except RuntimeError as outer:
        assert retry_after(outer) == 9.0


def test_exception_chain_and_http_status():
    class Wrapper(Exception):
        def __init__(self, message, exc=None):
            super().__init__(message)
            self.exc = exc

    inner = http_error(503)
    wrapper = Wrapper("wrapped", exc=inner)
    assert exception_chain(wrapper) == [wrapper]
    assert exception_chain(wrapper, wrapped=("exc",)) == [wrapper, inner]
    assert http_status(wrapper, wrapped=("exc",)) == (503, inner.response)
    assert http_status(wrapper) == (None, None)
    try:
        try:
            raise ValueError("first")
        except ValueError:
            raise KeyError("second")  # noqa: B904 (an implicit __context__ is the point)
    except KeyError as exc:
        assert [type(e) for e in exception_chain(exc)] == [KeyError, ValueError]
    assert http_status(RuntimeError("... (Caused by ResponseError('too many 503 error responses'))")) == (503, None)
    coded = Exception("status on the exception")
    coded.status_code = 502
    assert http_status(coded) == (502, None)
    coded.status_code = True  # not a status
    assert http_status(coded) == (None, None)


def test_disk_full_is_recognised_anywhere_in_the_chain():
    enospc, sqlite_full = disk_full_error(), sqlite_full_error()
    assert enospc.errno == errno.ENOSPC and is_disk_full(enospc)
    assert "database or disk is full" in str(sqlite_full) and is_disk_full(sqlite_full)
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    try:
        raise RuntimeError("a tracker's own wrapper") from enospc
    except RuntimeError as wrapped:
        assert is_disk_full(wrapped)
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not is_disk_full(sqlite3.OperationalError("database is locked"))
    assert not is_disk_full(ValueError("No space left on device"))  # a message alone is not the fault


@pytest.mark.parametrize(
    "make, expected, seconds",
    [
        (lambda: http_error(429, {"Retry-After": "7"}), RateLimited, 7.0),
        (lambda: http_error(429), RateLimited, None),
        (lambda: RuntimeError("too many 429 error responses"), RateLimited, None),  # urllib3's text: no response
        (lambda: http_error(503), TransientError, None),
        (lambda: http_error(500), TransientError, None),
        (lambda: http_error(408), TransientError, None),
        (lambda: refused_connection(), TransientError, None),
        (lambda: TimeoutError("read timed out"), TransientError, None),
        (lambda: requests.ConnectionError("connection reset"), TransientError, None),
        (lambda: requests.Timeout("read timed out"), TransientError, None),
        (lambda: disk_full_error(), TransientError, None),
        (lambda: sqlite_full_error(), TransientError, None),
        (lambda: http_error(404), None, None),
        (lambda: http_error(401), None, None),
        (lambda: ValueError("bad value"), None, None),
        (lambda: OSError(errno.EACCES, "Permission denied"), None, None),
    ],
)
def test_map_errors(make, expected, seconds):
    original = make()
    out = raised(original)
    if expected is None:
        assert out is original  # propagates unchanged
        return
    assert type(out) is expected and out.__cause__ is original
    assert str(out).startswith("tracker: ")
    if expected is RateLimited:
        assert out.retry_after == seconds


def test_map_errors_with_a_trackers_own_rules():
    class TrackerError(Exception):
        pass

    class AuthError(TrackerError):
        pass

    assert isinstance(raised(TrackerError("timed out"), transient=(TrackerError,)), TransientError)
    auth = AuthError("bad key")
    assert raised(auth, transient=(TrackerError,), permanent=(AuthError,)) is auth
    try:
        raise AuthError("cannot write the key file") from disk_full_error()
    except AuthError as exc:
        assert isinstance(raised(exc, permanent=(AuthError,)), TransientError)  # a full disk is always worth a retry
    broken_pipe = BrokenPipeError(errno.EPIPE, "Broken pipe")
    assert raised(broken_pipe, permanent=(OSError,)) is broken_pipe  # a ConnectionError, but the sink says no
    locked = RuntimeError("database is locked")
    special = raised(locked, classify=lambda e: TransientError("busy") if "locked" in str(e) else None)
    assert type(special) is TransientError and str(special) == "busy" and special.__cause__ is locked
    already = RateLimited(3.0)
    assert raised(already) is already  # rllog's own errors pass through
    assert retry_error(http_error(429, {"Retry-After": "1"}), "x").retry_after == 1.0
    assert retry_error(ValueError("no")) is None


def test_imports_no_tracker_and_no_backend_imports_the_delivery_layer():
    code = "import sys, rllog.sink_errors; bad = [m for m in ('requests', 'urllib3', 'httpx', 'wandb', 'mlflow', 'comet_ml', 'trackio', 'tensorboard') if m in sys.modules]; assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    for path in sorted((ROOT / "rllog_backends").glob("*.py")):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
        assert "rllog.delivery" not in imported, path.name
