"""How rllog writes its messages (the run's opening line, the finish summary, what happens to a sink) to the
trainer's stderr: one function, so that a stderr that is gone never stops a training. Shared by the trainer side and
the delivery side (docs/architecture.md, "Layers")."""

from __future__ import annotations

import sys


def say(text: str) -> None:
    """Write one of rllog's messages (a line or a summary) to this process's stderr.

    A stderr whose reader has gone (``python train.py 2>&1 | head``, a log collector that died: ``EPIPE``), a closed
    terminal (``EIO``) or a closed stream loses the message, never the training: the same words are in what
    ``finish`` returns, the cursor files and ``agent.log``.
    """
    stream = sys.stderr
    if stream is None:  # pythonw, or a daemon that closed descriptor 2 before Python started
        return
    try:
        print(text, file=stream, flush=True)
    except (OSError, ValueError):
        pass
