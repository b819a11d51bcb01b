"""Cursors: where each sink's delivery stands, persisted in ``RUN_DIR/delivery/<sink>.json``.

A cursor means durable: every readable record at or below ``seq`` (and every seq in ``ahead``) is held by the
sink for good, or dead-lettered. Only the follower of that sink writes it (under the sink's lock file); the
trainer, the agent's supervisor and ``rllog show`` read it. The file format is in docs/formats.md and below.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from rllog.errors import SinkBusy
from rllog.files import replace_file

log = logging.getLogger("rllog.delivery")


class SinkState:
    """A sink's delivery state, as written in its cursor file."""

    WAITING = "waiting"  # no deliverer has started
    RUNNING = "running"
    CLOSED = "closed"  # saw the end (or the trainer's death), closed the sink
    FAILED = "failed"  # a permanent error: open/flush/close failed, or MAX_SUSPECTS records in a row
    GAVE_UP = "gave_up"  # transient errors for longer than RetryPolicy.give_up_after
    STOPPED = "stopped"  # the deliverer was told to stop while retrying

    BROKEN = (FAILED, GAVE_UP)


RETRY_NOTE = "retrying since"  # how a cursor's error starts while its follower retries (see Follower._call)


@dataclass
class Cursor:
    """What a sink's cursor file holds.

    Attributes:
        seq: every readable record with a seq at or below this is durable in the sink (or dead-lettered).
        ahead: seqs above ``seq`` that are durable too (a batch that failed midway).
        dead_letters: records the sink rejected for good: ``{"seq", "step", "kind", "error"}``
            (the first :data:`DEAD_LETTERS_KEPT`); ``dead_letter_count`` is exact.
        damage: what the reader skipped (damaged bytes, torn tails), and where (each place counted once).
    """

    seq: int = 0
    ahead: list[int] = field(default_factory=list)
    state: str = SinkState.WAITING
    error: str | None = None
    status: str | None = None
    dead_letters: list[dict] = field(default_factory=list)
    dead_letter_count: int = 0
    damage: dict[str, Any] = field(default_factory=dict)
    pid: int | None = None
    time: float | None = None

    @classmethod
    def from_dict(cls, data: dict) -> Cursor:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


CURSOR_FORMAT = 2
CURSOR_FILE_BYTES = 4096  # a cursor file's size (and the step it grows by): one page, written over in one pwrite
CURSOR_READ_TRIES = 5  # reads of a cursor that fails its checksum (a save in progress) before it counts as damaged
_CURSOR_PREFIX = re.compile(rb'^\{"format":(\d+),"crc":"([0-9a-f]{8})",')


class CursorStore:
    """The persisted delivery position and state of one sink of one run (``RUN_DIR/delivery/<sink>.json``).

    The file is written over in place, never replaced: a disk the journal filled (or anything else did) must not
    stop a sink's cursor from moving, and a new file and a rename need a block and a directory entry each time.
    Format 2: one JSON object, ``{"format":2,"crc":"<crc32 hex>",<the cursor's fields>}``, padded with spaces
    and a newline to a fixed size (:data:`CURSOR_FILE_BYTES`, or a multiple of it for a cursor that outgrew it:
    a long dead-letter list); ``crc`` is the CRC-32 of ``{<the cursor's fields>}`` as written. The file is made
    at that size once (its blocks allocated) and then written with one ``pwrite`` at offset 0: no new inode or
    block is needed. A reader that races a write sees a checksum that does not match and reads again. The file is
    still JSON (``json.load`` reads it); a format-1 file (the cursor's fields as plain JSON) loads as before and
    is replaced by a format-2 file at the next save.
    """

    def __init__(self, run_dir: str | os.PathLike, sink_name: str):
        self.directory = Path(run_dir) / "delivery"
        self.path = self.directory / f"{sink_name}.json"
        self._lock_path = self.directory / f"{sink_name}.lock"
        self._lock: FileLock | None = None

    @staticmethod
    def names(run_dir: str | os.PathLike) -> list[str]:
        """The sinks that have a cursor in ``run_dir``."""
        return sorted(p.stem for p in (Path(run_dir) / "delivery").glob("*.json"))

    def load(self) -> Cursor:
        for _ in range(CURSOR_READ_TRIES):
            try:
                data = self.path.read_bytes()
            except FileNotFoundError:
                return Cursor()
            fields = decode_cursor(data)
            if fields is not None:
                try:
                    return Cursor.from_dict(fields)
                except TypeError:
                    break
            time.sleep(0.001)  # a save in progress: it is one pwrite, done in microseconds
        log.warning("rllog: cursor file %s is damaged; delivery to that sink starts from the journal's start", self.path)
        return Cursor()

    def save(self, cursor: Cursor) -> None:
        body = json.dumps(cursor.__dict__, separators=(",", ":"))
        head = f'{{"format":{CURSOR_FORMAT},"crc":"{zlib.crc32(body.encode()):08x}",'
        text = head + body[1:]
        needed = len(text) + 1  # and a newline
        try:
            fd = os.open(self.path, os.O_WRONLY)
        except FileNotFoundError:
            fd = None
        if fd is not None:
            try:
                size = os.fstat(fd).st_size
                if size >= needed and size % CURSOR_FILE_BYTES == 0:
                    data = (text + " " * (size - needed) + "\n").encode()
                    if os.pwrite(fd, data, 0) == len(data):
                        return
                    raise OSError(errno.ENOSPC, f"cursor {self.path}: short write")
            finally:
                os.close(fd)
        size = -(-needed // CURSOR_FILE_BYTES) * CURSOR_FILE_BYTES  # made (or grown) at its fixed size, once
        replace_file(self.path, text + " " * (size - needed) + "\n")

    def acquire(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        # acquired by the thread that starts a follower, released by the follower thread itself
        self._lock = FileLock(str(self._lock_path), thread_local=False)
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            raise SinkBusy(f"another process is delivering to {self.path.stem!r} of this run (lock {self._lock_path})") from None

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()


def decode_cursor(data: bytes) -> dict | None:
    """The fields of a cursor file's content (format 2, or format 1: plain JSON); None when it fails its checksum
    or is not JSON (a save in progress, or damage)."""
    text = data.rstrip(b" \n")
    match = _CURSOR_PREFIX.match(text)
    if match is None:  # format 1
        try:
            fields = json.loads(text)
        except ValueError:
            return None
        return fields if isinstance(fields, dict) else None
    body = b"{" + text[match.end() :]
    if int(match[2], 16) != zlib.crc32(body):
        return None
    try:
        fields = json.loads(body)
    except ValueError:
        return None
    return fields if isinstance(fields, dict) else None
