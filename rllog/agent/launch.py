"""Starting an agent process: ``python -m rllog.agent`` with the trainer's stdout passed on (for the console
backend) and, for system metrics, a pipe back; and the exit codes that tell its supervisor what happened."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from rllog import settings
from rllog.sink import CONSOLE_FD_ENV

EXIT_SINKS_FAILED = 3  # every follower ended, some sink failed: nothing a restart would fix
EXIT_RESTART = 4  # a follower ran out of memory or descriptors in its own work: start the agent again from the cursors
OPTIONS_FROM_STDIN = "--options-stdin"
STANDBY_ARG = "--standby"


def _trainer_stdout() -> int | None:
    """A duplicate of the trainer's stdout for the console backend (the agent's own output goes to agent.log)."""
    try:
        return os.dup(sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # no real stdout (captured, closed)
        return None


# Runs the module named by its first argument at idle CPU priority from the agent's first instruction: the
# interpreter's start-up and ``import rllog`` (pyarrow among it; ~0.5 s of CPU) come before ``main`` could lower it,
# and on cores that training keeps busy that time came out of training. The module's name stays an argument of its
# own, so the agent is found by ``rllog.agent`` in its command line as with ``-m``.
IDLE_FROM_EXEC = (
    "import os, runpy, sys\n"
    "try:\n"
    "    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
    "except (AttributeError, OSError):\n"
    "    pass\n"
    "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)\n"
)


# The agent gets its own process group, so that a Ctrl-C aimed at the trainer (the terminal signals its foreground
# group) does not hit it, but stays in the trainer's session. A new session (``setsid``) is also a new scheduling
# group wherever Linux groups by session (``kernel.sched_autogroup_enabled=1``, the default of most distributions, for
# programs started from a terminal or ssh): the kernel then shares a busy CPU between the trainer's group and the
# agent's as equals, and ``SCHED_IDLE`` ranks the agent's threads only against each other. Measured (tiny GRPO, torch
# on both cores, parquet alone): the training thread waited behind the idle agent in whole 4 ms ticks while it started,
# 5-17 ms of a 60-step ``train()``; with the agent in the trainer's session, one tick in three trainings.
AGENT_PROCESS_GROUP = 0


def _own_process_group() -> dict[str, Any]:
    """``Popen``'s arguments for :data:`AGENT_PROCESS_GROUP` (Python 3.10 has no ``process_group``: a session of its
    own there, the one way to keep a Ctrl-C off the agent without running Python code between fork and exec)."""
    if sys.version_info >= (3, 11):
        return {"process_group": AGENT_PROCESS_GROUP}
    return {"start_new_session": True}


def launch(args: list[str], log_path: Path, system_interval: float | None) -> tuple[subprocess.Popen, int | None]:
    """Start ``python -m rllog.agent ARGS`` for this trainer (at idle priority from its start, see
    :data:`IDLE_FROM_EXEC`); returns the process and the read end of its system-metrics pipe (None without system
    metrics). Its stdin is a pipe: what it delivers comes that way."""
    console_fd = _trainer_stdout()
    env = dict(os.environ)
    start = ["-c", IDLE_FROM_EXEC] if settings.AGENT_PRIORITY.get() == "idle" else ["-m"]
    command = [sys.executable, *start, "rllog.agent", *args, "--follow", "--parent-pid", str(os.getpid()), OPTIONS_FROM_STDIN]
    passed = []
    if console_fd is not None:
        env[CONSOLE_FD_ENV] = str(console_fd)
        passed.append(console_fd)
    samples_read = samples_write = None
    try:  # from the first descriptor taken: a trainer out of them retries every 2 s, and each try must give back all
        if system_interval:
            samples_read, samples_write = os.pipe()
            passed.append(samples_write)
            command += ["--system-metrics-fd", str(samples_write), "--system-interval", str(system_interval)]
        with open(log_path, "ab") as log_file:
            proc = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                **_own_process_group(),
                close_fds=True,
                pass_fds=tuple(passed),
                env=env,
            )
    except BaseException:
        if samples_read is not None:
            os.close(samples_read)
        raise
    finally:
        for fd in (console_fd, samples_write):
            if fd is not None:
                os.close(fd)
    return proc, samples_read
