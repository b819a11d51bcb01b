"""Small files replaced whole, and the disk space the journal keeps for itself.

The run directory's small files (``run.json``, the trackers' remembered runs) and DVCLive's table files are
written with :func:`replace_file`; a reader sees the old content or the new, never a torn write. (Cursor files
are made with it once, then written over in place: :class:`rllog.delivery.CursorStore`.) It lives here, below
:mod:`rllog.delivery`, so that backends (which must not import the delivery layer) can use it too; so do the
journal's reserve (:func:`reserve`) and the free space derived writers leave to it (:func:`free_bytes`).

On Linux the new file is swapped with the old one (``renameat2(RENAME_EXCHANGE)``) rather than renamed over it:
ext4 writes a file renamed over another to disk at once (its ``auto_da_alloc`` heuristic, there for programs that
skip ``fsync``), which made each cursor save and flush request a disk write, ~80 in a 60-step GRPO run, with an
interrupt and an I/O-completion worker on one of the machine's CPUs each time (docs/decisions.md). A swap is as
atomic for readers and for a killed process; like the rename, it does not promise the file survives a power cut.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from pathlib import Path
from typing import Any

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _load_renameat2() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None).renameat2
    except (OSError, AttributeError):  # a libc older than glibc 2.28
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_renameat2 = _load_renameat2()


def _swap(new: Path, old: Path) -> bool:
    """Exchange ``new`` and ``old`` atomically; False when that was not done (``old`` missing, no such call, a file
    system without the flag such as NFS, or layers of an overlay), so the caller renames instead: the rename
    raises the error that matters, if there is one."""
    if _renameat2 is None:
        return False
    return _renameat2(_AT_FDCWD, os.fsencode(new), _AT_FDCWD, os.fsencode(old), _RENAME_EXCHANGE) == 0


def replace_file(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically: a temporary file (one per thread) swapped with the old one
    (or renamed to ``path`` when there is none), removed if the write fails (a full disk) or is interrupted.

    Example:
        >>> replace_file(Path(run_dir) / "delivery" / "flush-request", "42")  # doctest: +SKIP
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        if not _swap(tmp, path):
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # after a swap: the old content


# -- disk space shared with the journal ---------------------------------------------------------------------
#
# The journal is the run's source of truth and shares its disk with what is derived from it (the Parquet store,
# cursor files, trackers' files). Its writer keeps JOURNAL_RESERVE_BYTES allocated ahead of its end
# (:func:`reserve`), so that its next writes cannot fail for want of space whoever fills the disk, and derived
# writers refuse to write when the disk has less free than JOURNAL_RESERVE_MIN_BYTES while the journal holds a
# reserve (:func:`holds_reserve`: its writer is live; it gives the reserve back when it ends), so that the journal
# can always top its reserve up while only they compete with it (docs/decisions.md).
JOURNAL_RESERVE_BYTES = 1024 * 1024  # ~2,000 steps of 20 metrics, minutes of a fast trainer's logging
JOURNAL_RESERVE_MIN_BYTES = 64 * 1024  # the smallest top-up the writer asks for; derived writers leave this free

_FALLOC_FL_KEEP_SIZE = 1  # allocate blocks past the end without changing st_size (readers go by st_size)


def _load_fallocate() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    function.restype = ctypes.c_int
    return function


_fallocate = _load_fallocate()


def reserve(fd: int, offset: int, length: int) -> bool:
    """Allocate ``length`` bytes of disk to ``fd`` from ``offset`` on, past its end, without changing its size:
    writes there cannot fail for want of space. False when the disk has not that much free (nothing is allocated
    then) or the file system cannot (not Linux, or no ``fallocate``, as on some network file systems)."""
    if _fallocate is None:
        return False
    return _fallocate(fd, _FALLOC_FL_KEEP_SIZE, offset, length) == 0


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer can still allocate on the file system of ``path`` (None if unknown)."""
    try:
        st = os.statvfs(path)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


def holds_reserve(directory: Path) -> bool:
    """Whether a file of ``directory`` has disk allocated past its end (a :func:`reserve`): a journal writer is live.

    A page or two past the end is a file system's rounding, not a reserve."""
    try:
        files = list(os.scandir(directory))
    except OSError:
        return False
    for entry in files:
        try:
            st = entry.stat()
        except OSError:
            continue
        if st.st_blocks * 512 >= st.st_size + JOURNAL_RESERVE_MIN_BYTES:
            return True
    return False
