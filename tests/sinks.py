"""Sinks for fault injection and for observing delivery order in tests (never to prove a tracker works),
and the waits and faults the tests share."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rllog.errors import RateLimited, TransientError
from rllog.records import RunInfo
from rllog.sink import Capabilities


class MemorySink:
    """Keeps what it is given, in memory."""

    capabilities = Capabilities(tables=True)

    def __init__(self, name: str | None = None):
        if name:
            self.name = name
        self.metrics: list = []
        self.tables: list = []
        self.opened = None
        self.closed_with = None
        self.flushes = 0
        self.metric_calls = 0
        self.received = threading.Condition()

    def open(self, run_info):
        self.opened = run_info

    def write_metrics(self, records):
        with self.received:
            self.metric_calls += 1
            self.metrics.extend(records)
            self.received.notify_all()

    def write_table(self, record):
        self.tables.append(record)

    def flush(self):
        self.flushes += 1

    def close(self, status):
        self.closed_with = status

    def wait_for(self, n: int, timeout: float = 30.0) -> bool:
        with self.received:
            return self.received.wait_for(lambda: len(self.metrics) >= n, timeout)

    @property
    def seqs(self) -> list[int]:
        return [r.seq for r in self.metrics]


class BlockingSink(MemorySink):
    """Blocks in write_metrics until ``release`` is set."""

    def __init__(self, name: str | None = None):
        super().__init__(name)
        self.release = threading.Event()
        self.entered = threading.Event()

    def write_metrics(self, records):
        self.entered.set()
        self.release.wait()
        super().write_metrics(records)


class FlakySink(MemorySink):
    """Raises ``errors`` (in order) on the first calls to write_metrics, then works."""

    def __init__(self, errors, name: str | None = None):
        super().__init__(name)
        self.errors = list(errors)
        self.attempts = 0

    def write_metrics(self, records):
        self.attempts += 1
        if self.errors:
            raise self.errors.pop(0)
        super().write_metrics(records)


class CrashingSink(MemorySink):
    """Raises on every write."""

    def write_metrics(self, records):
        raise RuntimeError("tracker exploded")


def backend_run_info(
    where: str | os.PathLike | dict,
    *,
    project: str = "grpo-math",
    name: str = "grpo-run",
    run_id: str = "r0001",
    config: dict | None = None,
    run_dir: str | os.PathLike | None = None,
    **fields: Any,
) -> RunInfo:
    """The ``RunInfo`` a backend test opens its sink with (each test module sets its defaults with ``partial``).

    ``where``: the test's tmp directory, or the ``tracker_dirs`` dict (its ``tmp``); the run directory is
    ``<where>/run`` unless ``run_dir`` says otherwise. ``fields``: the other ``RunInfo`` fields (tags, attempts, ...).
    """
    base = Path(where["tmp"] if isinstance(where, dict) else where)
    directory = Path(run_dir) if run_dir is not None else base / "run"
    return RunInfo(project, name, str(directory), run_id, {} if config is None else config, **fields)


def thread_wakeups(native_id: int) -> int:
    """How many times a thread of this process went to sleep and was woken (its voluntary context switches)."""
    status = Path(f"/proc/self/task/{native_id}/status").read_text()
    return int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])


@contextlib.contextmanager
def busy_cpus(busy: bool = True) -> Iterator[None]:
    """Threads of this process that keep every CPU it may use busy for the block's length (a CPU-bound training on
    every core): hashlib releases the GIL, so the test's own thread still runs."""
    stop = threading.Event()
    data = b"x" * 50_000_000

    def spin() -> None:
        while not stop.is_set():
            hashlib.sha256(data).digest()

    spinners = [threading.Thread(target=spin, daemon=True) for _ in range(len(os.sched_getaffinity(0)) if busy else 0)]
    for t in spinners:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in spinners:
            t.join()


def wait_until(predicate, timeout: float = 60.0) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds passed (a condition, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


__all__ = [
    "BlockingSink",
    "CrashingSink",
    "FlakySink",
    "MemorySink",
    "RateLimited",
    "TransientError",
    "backend_run_info",
    "wait_until",
]


class CannotMount(RuntimeError):
    """No small disk here: mounting a tmpfs needs root (CI and the developers' machines have it), or mount refused."""


@contextlib.contextmanager
def mounted_tmpfs(directory: Path, options: str) -> Iterator[Path]:
    """A real filesystem (tmpfs, mount ``options`` such as ``size=4m``) at ``directory``, made here, that can be
    filled and freed; unmounted after. Raises :class:`CannotMount` (outside pytest: the explorer's soak)."""
    if os.geteuid() != 0:
        raise CannotMount("mounting a tmpfs needs root (CI and the developers' machines have it)")
    directory.mkdir(parents=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(directory)], capture_output=True, text=True)
    if mount.returncode:
        raise CannotMount(f"mount -t tmpfs -o {options} failed: {mount.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


def cannot_mount(exc: CannotMount) -> None:
    """A test that needs a small disk and has none: it fails loudly under CI (``CI=true``, which runs as root, so a
    full-disk test that skipped there would pass without testing anything) and skips with the reason elsewhere."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"no small disk under CI: {exc}")
    pytest.skip(f"no small disk: {exc}")


@contextlib.contextmanager
def tmpfs(directory: Path, options: str) -> Iterator[Path]:
    """:func:`mounted_tmpfs` for a test (see :func:`cannot_mount`); the ``small_disk`` fixture (tests/conftest.py)
    is a 4 MiB one."""
    try:
        disk = mounted_tmpfs(directory, options)
        path = disk.__enter__()
    except CannotMount as exc:
        cannot_mount(exc)
    try:
        yield path
    finally:
        disk.__exit__(None, None, None)


def fill(disk: Path) -> Path:
    """Fill ``disk`` to the last byte; returns the filler to delete. Unbuffered: a buffered file would keep
    what the full disk refused and raise again when closed."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        for size in (1 << 20, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    return filler
