"""Small files replaced whole: the one helper for writing them atomically.

The run directory's small files (cursors, the flush request, ``run.json``, the trackers' remembered runs) and
DVCLive's table files are written with :func:`replace_file`; a reader sees the old content or the new, never
a torn write. It lives here, below :mod:`rllog.delivery`, so that backends (which must not import the delivery
layer) can use it too.

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
