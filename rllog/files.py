"""Small files replaced whole: the one helper for writing them atomically.

The run directory's small files (cursors, the flush request, ``run.json``, the trackers' remembered runs) and
DVCLive's table files are written with :func:`replace_file`; a reader sees the old content or the new, never
a torn write. It lives here, below :mod:`rllog.delivery`, so that backends (which must not import the delivery
layer) can use it too.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


def replace_file(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically: a temporary file (one per thread) renamed over the old one,
    removed if the write fails (a full disk) or is interrupted.

    Example:
        >>> replace_file(Path(run_dir) / "delivery" / "flush-request", "42")  # doctest: +SKIP
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
