"""What the trainer's stderr is told about a sink, the moment it happens: one line each, the same words whether the
follower runs in the trainer (``delivery="thread"``) or in the agent (whose supervisor reads them off the cursor).
They are written with :func:`rllog.messages.say`."""

from __future__ import annotations

import os


def failed(name: str, error: str | None, run_dir: str | os.PathLike) -> str:
    """A sink that failed, gave up, or was found broken: its records wait in the journal."""
    return (
        f"rllog: delivery to {name!r} failed ({error}); its records stay in the journal "
        f"({run_dir}): `rllog replay {run_dir} --to {name}` once the cause is fixed"
    )


def dead_lettering(name: str, seq: int, step: int, error: str, run_dir: str | os.PathLike) -> str:
    """The first record a sink rejected for good (said once per sink: later ones are counted, not said)."""
    return (
        f"rllog: {name!r} rejected record seq {seq} (step {step}) for good ({error}); it and any later record it "
        f"rejects go to its dead-letter list ({os.path.join(run_dir, 'delivery', name + '.json')}, counted in the "
        "report) and delivery to it goes on"
    )


def waiting(name: str, note: str, run_dir: str | os.PathLike) -> str:
    """A sink whose follower has retried one error for a while (a tracker down, no descriptor left)."""
    return f"rllog: delivery to {name!r} is waiting, {note}; its records stay in the journal ({run_dir})"
