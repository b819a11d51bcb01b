"""Flush requests and the flush schedule: when a follower calls its sink's ``flush()``.

A sink is flushed at least every ``flush_interval`` while records flow, at the end of the journal, once
:data:`FLUSH_DUE_RECORDS` records or :data:`FLUSH_DUE_BYTES` were read since its last flush (a backlog read at
full speed reaches the sink's storage in bounded pieces), and as soon as its follower has delivered every record
up to a seq the trainer asked for (:func:`request_flush`, written by ``Run.flush`` and by
``Run.request_flush(at_once=True)``: the end of ``train()``/``evaluate()``, which does not wait). A request nobody
waits for (``Run.request_flush()``, ``soon=True``) is honoured at most every :data:`ASKED_FLUSH_MIN_GAP`: when the
HF integration asked so at every step of the last second of training, one flush per step made MLflow's and
trackio's fixed cost per transaction the agent's largest cost in that second (MLflow 20 ms of CPU per one-step
flush against 7 ms per step in larger ones). ``Run.request_flush`` writes the request before the journal holds its
records: a follower that read too early looks again every :data:`POLL_INTERVAL` for :data:`ASKED_RECORDS_PATIENCE`.
Not every time a follower catches up with the journal: with SQLite-backed trackers (MLflow, trackio) a flush is a
transaction with several ``fdatasync``s, and one per step slowed the training process on the other core.

How often a follower reads the journal: at once again after a batch, and every ``poll_interval`` once it has
caught up. A live run's followers poll every half ``flush_interval`` (:func:`live_poll_interval`: 0.5 s by
default), so each sink takes half a second of steps in one call rather than one step per call (five trackers:
20-22 ms of the agent's CPU per training step instead of 25-31 at 0.05 s); a flush request wakes them at once
(:meth:`rllog.delivery.Follower.wake`, :class:`FlushWatcher`), so ``Run.flush`` waits no longer for it.

The trainer's side: :func:`request_flush` to ask (with :func:`wake_watcher` to wake the agent), :func:`wait_flushed`
to wait for the cursors.
"""

from __future__ import annotations

import errno
import math
import os
import select
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from rllog.delivery.cursor import CursorStore, SinkState
from rllog.settings import (  # the tuning constants, each explained there
    ASKED_FLUSH_MIN_GAP,
    ASKED_RECORDS_PATIENCE,
    FLUSH_DUE_BYTES,
    FLUSH_DUE_RECORDS,
    FLUSH_FAST_POLL_FOR,
    FLUSH_POLL_SECONDS,
    FLUSH_SLOW_POLL_SECONDS,
    FLUSH_WATCH_IDLE_CHECK,
    LIVE_POLL_MAX,
    POLL_INTERVAL,
)

__all__ = [
    "ASKED_FLUSH_MIN_GAP",
    "ASKED_RECORDS_PATIENCE",
    "FINISH_DEADLINE",
    "FLUSH_DUE_BYTES",
    "FLUSH_DUE_RECORDS",
    "FLUSH_FAST_POLL_FOR",
    "FLUSH_POLL_SECONDS",
    "FLUSH_REQUEST",
    "FLUSH_SLOW_POLL_SECONDS",
    "FLUSH_WAKEUP",
    "FLUSH_WATCH_IDLE_CHECK",
    "LIVE_POLL_MAX",
    "POLL_INTERVAL",
    "FlushRequest",
    "FlushSchedule",
    "FlushWatcher",
    "finish_deadline",
    "forget_finish_deadline",
    "live_poll_interval",
    "read_flush_request",
    "request_flush",
    "tell_finish_deadline",
    "wait_flushed",
    "wake_watcher",
]

FLUSH_REQUEST = "flush-request"  # RUN_DIR/delivery/flush-request: one fixed-length line, see request_flush
FINISH_DEADLINE = "finish-deadline"  # RUN_DIR/delivery/finish-deadline: written by finish, see tell_finish_deadline
# What the trainer writes down the agent's stdin after each request (:func:`wake_watcher`): the request itself stays
# in the file, the durable record (a request left by a killed trainer is acted on by the next agent's followers).
FLUSH_WAKEUP = b"f"
WAKEUPS_READ_BYTES = 4096  # wake-ups taken in one read: any number of them wakes the followers once
SOON = "soon"
WAITED = "wait"


def request_flush(run_dir: str | os.PathLike, seq: int, soon: bool = False, wake: Callable[[], object] | None = None) -> None:
    """Ask every follower of the run to flush its sink as soon as it has delivered the records up to ``seq``.

    ``soon``: nobody waits for this flush (``Run.request_flush()``); a follower may put it off for up to
    :data:`ASKED_FLUSH_MIN_GAP` after its previous flush. Without it (``Run.flush``, and
    ``Run.request_flush(at_once=True)`` at the end of ``train()``), it is made at once.

    The request is one line, ``<seq> <soon|wait> <nonce> <crc32>``, every field fixed-width, written over the
    previous one in place: an ``open`` and a ``write``, with no new file to create, rename and delete in the run's
    directory (that cost 0.2-0.4 ms of the training thread's CPU a call while the agent worked in the same
    directory, when the last second of ``train()`` asked at every step). The nonce makes every request new to a reader;
    the checksum lets a reader that raced the write see it as not written yet (:func:`read_flush_request`).

    ``wake``: called once the line is written, to wake the agent's :class:`FlushWatcher` (``AgentProcess``'s
    :func:`wake_watcher`); the file stays the durable record that a new agent's followers act on.

    Raises:
        OSError: the request could not be written (a full disk); nobody is woken.
    """
    body = f"{int(seq):020d} {SOON if soon else WAITED} {time.monotonic_ns() % 10**20:020d}"
    line = f"{body} {zlib.crc32(body.encode()):08x}\n".encode()
    path = Path(run_dir) / "delivery" / FLUSH_REQUEST
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    except FileNotFoundError:  # no follower has made the directory yet
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, line)
    finally:
        os.close(fd)
    if written != len(line):  # a full disk: the line would read as torn (refused), like no request
        raise OSError(errno.ENOSPC, f"flush request: wrote {written} of {len(line)} bytes")
    if wake is not None:
        wake()


def tell_finish_deadline(run_dir: str | os.PathLike, deadline: float) -> None:
    """Tell the agent when ``finish`` stops waiting for it: ``deadline`` in ``time.monotonic()`` seconds
    (``CLOCK_MONOTONIC``, one clock for every process of the machine). A follower whose next try of its sink comes
    after it (a 429 asking for an hour) is then stopped at once, as it would be at the deadline, and ``finish`` does
    not wait the deadline out for nothing (:func:`finish_deadline`). One line, ``<trainer pid> <deadline>``: an agent
    heeds only its own trainer's.

    Raises:
        OSError: it could not be written (a full disk); the agent is then stopped at the deadline.
    """
    path = Path(run_dir) / "delivery" / FINISH_DEADLINE
    path.parent.mkdir(parents=True, exist_ok=True)
    written = path.with_name(f"{FINISH_DEADLINE}.{os.getpid()}.tmp")
    try:
        written.write_text(f"{os.getpid()} {deadline!r}\n")
        os.replace(written, path)  # a reader sees the whole line or the one before, never a part
    except OSError:
        written.unlink(missing_ok=True)
        raise


def finish_deadline(run_dir: str | os.PathLike, trainer_pid: int | None) -> float | None:
    """The deadline :func:`tell_finish_deadline` wrote for this run's ``finish`` by ``trainer_pid``; None when there is
    none yet, or it is another trainer's (an earlier attempt's), or being written."""
    try:
        pid, deadline = (Path(run_dir) / "delivery" / FINISH_DEADLINE).read_text().split()
        return float(deadline) if trainer_pid is not None and int(pid) == trainer_pid else None
    except (OSError, ValueError):
        return None


def forget_finish_deadline(run_dir: str | os.PathLike) -> None:
    """Remove an earlier attempt's deadline before a run (resumed in the same process) starts its agent."""
    (Path(run_dir) / "delivery" / FINISH_DEADLINE).unlink(missing_ok=True)


def read_flush_request(run_dir: str | os.PathLike) -> tuple[bytes, int, bool] | None:
    """The last request: (its line, seq, soon), or None when there is none or it is being written."""
    try:
        with open(Path(run_dir) / "delivery" / FLUSH_REQUEST, "rb") as f:
            line = f.read(128)
        body, crc = line.decode("ascii").rstrip("\n").rsplit(" ", 1)
        if int(crc, 16) != zlib.crc32(body.encode()):
            return None
        seq, kind, _nonce = body.split(" ")
        return line, int(seq), kind == SOON
    except (OSError, ValueError):  # missing, or read while being written over (torn: the checksum does not match)
        return None


def live_poll_interval(flush_interval: float) -> float:
    """A live run's follower polls every half flush interval, between :data:`POLL_INTERVAL` and :data:`LIVE_POLL_MAX`."""
    return min(LIVE_POLL_MAX, max(POLL_INTERVAL, flush_interval / 2))


class FlushRequest:
    """The follower's view of :func:`request_flush`.

    ``seq``: the seq of the latest request; ``waited_seq``: that of the latest one a ``Run.flush`` waits for. The
    latest, not the highest ever read: a trainer killed between writing a request and journaling the records it
    names leaves a seq the journal never got, the resumed run numbers its records below it, and taking the highest
    ignored every request of the resumed run until its records passed that seq (its ``flush`` then waited for
    the periodic one).
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = run_dir
        self._seen: bytes | None = None
        self.seq = 0
        self.waited_seq = 0
        self.noticed_at = -math.inf  # monotonic time the latest request that is waited for was first read

    def replaced(self) -> bool:
        """Whether a request was written since the last look (the seq read then)."""
        request = read_flush_request(self.run_dir)
        if request is None or request[0] == self._seen:
            return False
        self._seen, seq, soon = request
        self.seq = seq
        if not soon:
            self.waited_seq = seq
            self.noticed_at = time.monotonic()
        return True


class Wakeable(Protocol):
    """What :class:`FlushWatcher` needs of a follower."""

    thread: threading.Thread | None

    def wake(self) -> None: ...


class FlushWatcher:
    """Wakes the followers of a run in another process (the agent) when the trainer asks for a flush, and when
    the trainer is gone (``writer_gone``).

    One thread blocks on ``wakeups``, the read end of the pipe the trainer writes :data:`FLUSH_WAKEUP` to after each
    request (:func:`request_flush`'s ``wake``; the agent's stdin), so the followers can wait a whole
    :func:`live_poll_interval` between reads of the journal without making ``Run.flush`` wait for it, and an idle
    agent spends no CPU on the watch. End of file on the pipe (the trainer exited, or closed it at ``finish``) wakes
    the followers too. Without a pipe, or after its end, the thread only looks every ``idle_check`` whether the
    trainer is gone; the followers still read the request file at each of their polls (:class:`FlushSchedule`).

    ``looks``: how many times the thread woke up (a byte, the pipe's end, or ``idle_check``).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        followers: Sequence[Wakeable],
        writer_gone: Callable[[], bool] = lambda: False,
        wakeups: int | None = None,
        idle_check: float = FLUSH_WATCH_IDLE_CHECK,
    ):
        self.request = FlushRequest(run_dir)
        self.request.replaced()  # a request from before this agent started is not news
        self.followers = followers
        self.writer_gone = writer_gone
        self.wakeups = wakeups
        self.idle_check = idle_check
        self.looks = 0

    def start(self) -> FlushWatcher:
        threading.Thread(target=self._run, name="rllog-flush-watcher", daemon=True).start()
        return self

    def _wait(self) -> bool:
        """Block until a wake-up byte, the pipe's end or ``idle_check``; True when the trainer sent a byte or closed
        the pipe."""
        if self.wakeups is None:
            time.sleep(self.idle_check)
            return False
        readable, _, _ = select.select([self.wakeups], [], [], self.idle_check)
        if not readable:
            return False
        if not os.read(self.wakeups, WAKEUPS_READ_BYTES):  # every write end closed: no more requests come this way
            self.wakeups = None
        return True

    def _run(self) -> None:
        gone = False
        while any(f.thread is not None and f.thread.is_alive() for f in self.followers):
            woken = self._wait()
            self.looks += 1
            just_gone = not gone and self.writer_gone()
            gone = gone or just_gone
            # The pipe's end (woken, no pipe left) wakes them without a look at the file: the trainer exited or is
            # finishing, and each follower reads the request itself once woken.
            if just_gone or (woken and (self.wakeups is None or self.request.replaced())):
                for follower in self.followers:
                    follower.wake()


def wake_watcher(fd: int) -> bool:
    """Send :data:`FLUSH_WAKEUP` down the non-blocking pipe ``fd`` (to the agent's :class:`FlushWatcher`), after
    :func:`request_flush` wrote the request. False when nobody reads the pipe any more (the agent died: its
    successor reads the request file when it starts). A full pipe holds wake-ups not read yet: the watcher wakes
    for those, which is all this one would do."""
    try:
        os.write(fd, FLUSH_WAKEUP)
    except BlockingIOError:
        return True
    except OSError:  # EPIPE: the agent is gone
        return False
    return True


def wait_flushed(run_dir: str | os.PathLike, sink_names: Sequence[str], seq: int, deadline: float) -> bool:
    """Wait until every sink's cursor is at ``seq`` or beyond, or the sink is broken (nobody waits for a failed sink),
    or the monotonic ``deadline``; True when none is left behind. The trainer's half of ``Run.flush`` (after
    :func:`request_flush`): fast polls for :data:`FLUSH_FAST_POLL_FOR`, then slower ones that cost next to no CPU."""
    started = time.monotonic()
    stores = [CursorStore(run_dir, name) for name in sink_names]
    while True:
        cursors = [store.load() for store in stores]
        if all(c.seq >= seq or c.state in SinkState.BROKEN for c in cursors):
            return True
        now = time.monotonic()
        if now >= deadline:
            return False
        fast = now - started < FLUSH_FAST_POLL_FOR
        time.sleep(min(FLUSH_POLL_SECONDS if fast else FLUSH_SLOW_POLL_SECONDS, max(0.0, deadline - now)))


class FlushSchedule:
    """One follower's flush timing: when its sink is due a flush, and how long it waits before it reads again.

    Args:
        run_dir: where the trainer's requests are (:func:`request_flush`).
        flush_interval: the sink is flushed at least this often while records flow.
        poll_interval: a caught-up follower's wait before it reads the journal again.
    """

    def __init__(self, run_dir: str | os.PathLike, flush_interval: float, poll_interval: float):
        self.request = FlushRequest(run_dir)
        self.flush_interval = flush_interval
        self.poll_interval = poll_interval
        self.last_flush = time.monotonic()
        self.unflushed_records = 0  # read since the last flush (see FLUSH_DUE_RECORDS)
        self.unflushed_bytes = 0

    def read(self, records: int, payload_bytes: int) -> None:
        """Count what a read of the journal took (a large backlog is flushed in bounded pieces)."""
        self.unflushed_records += records
        self.unflushed_bytes += payload_bytes

    def flushed(self) -> None:
        self.unflushed_records = self.unflushed_bytes = 0

    def restart_clock(self) -> None:
        self.last_flush = time.monotonic()

    def due(self, durable_seq: int, delivered_seq: int) -> bool:
        """Whether to flush the sink now: ``flush_interval`` has passed since the last flush, enough was read, or the
        trainer asked (:func:`request_flush`) for records delivered (up to ``delivered_seq``) but not durable (above
        ``durable_seq``). A request nobody waits for is put off until :data:`ASKED_FLUSH_MIN_GAP` after the previous
        flush (see :meth:`wait_before_reading`)."""
        since = time.monotonic() - self.last_flush
        if since >= self.flush_interval:
            return True
        if self.unflushed_records >= FLUSH_DUE_RECORDS or self.unflushed_bytes >= FLUSH_DUE_BYTES:
            return True
        request = self.request
        request.replaced()
        if durable_seq < request.waited_seq <= delivered_seq:
            return True
        return durable_seq < request.seq <= delivered_seq and since >= ASKED_FLUSH_MIN_GAP

    def wait_before_reading(self, dirty: bool, durable_seq: int, delivered_seq: int) -> float:
        """How long a caught-up follower waits before it reads again: ``poll_interval``; :data:`POLL_INTERVAL` while
        a flush was just asked for records not in the journal yet (:data:`ASKED_RECORDS_PATIENCE`); or until a
        flush it put off (asked for records it holds unflushed, ``dirty``) is due."""
        request = self.request
        request.replaced()
        if request.waited_seq > delivered_seq and time.monotonic() - request.noticed_at < ASKED_RECORDS_PATIENCE:
            return min(self.poll_interval, POLL_INTERVAL)
        if not (dirty and durable_seq < request.seq <= delivered_seq):
            return self.poll_interval
        return min(self.poll_interval, max(0.0, self.last_flush + ASKED_FLUSH_MIN_GAP - time.monotonic()))
