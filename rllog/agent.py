"""The delivery agent: ``python -m rllog.agent RUN_DIR --follow``.

Started by :func:`rllog.init` in its own session (a Ctrl-C aimed at the trainer does not hit it).
It imports and opens the trackers named in ``RUN_DIR/run.json`` and runs one
:class:`rllog.delivery.Follower` thread per sink. It exits when every follower has seen the journal's
end marker and closed its sink. If the trainer dies without ``finish``, the followers deliver what the
journal holds and close their sinks with status ``killed``.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

AGENT_LOG = "agent.log"
EXIT_SINKS_FAILED = 3  # every follower ended, some sink failed: nothing a restart would fix


CONSOLE_FD_ENV = "RLLOG_CONSOLE_FD"


def _trainer_stdout() -> int | None:
    """A duplicate of the trainer's stdout for the console backend (the agent's own output goes to agent.log)."""
    try:
        return os.dup(sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # no real stdout (captured, closed)
        return None


def start_agent(run_dir: Path) -> subprocess.Popen:
    """Start the agent for ``run_dir``; returns at once (tracker imports happen in the child)."""
    log_file = open(Path(run_dir) / AGENT_LOG, "ab")
    console_fd = _trainer_stdout()
    env = dict(os.environ)
    if console_fd is not None:
        env[CONSOLE_FD_ENV] = str(console_fd)
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "rllog.agent", str(run_dir), "--follow", "--parent-pid", str(os.getpid())],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            pass_fds=(console_fd,) if console_fd is not None else (),
            env=env,
        )
    finally:
        log_file.close()
        if console_fd is not None:
            os.close(console_fd)


def stop_agent(proc: subprocess.Popen, deadline: float) -> bool:
    """Wait until ``deadline`` (monotonic) for the agent to exit; then stop it. True if it exited by itself."""
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        return True
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return False


def serve(run_dir: str, follow: bool, parent_pid: int | None, only: list[str] | None = None, orphan_timeout: float = 600.0, on_progress=None) -> int:
    """Deliver ``run_dir`` to its sinks (or to ``only``, by name); returns the number of sinks that failed."""
    from rllog import registry
    from rllog.delivery import CLOSED, Follower, RetryPolicy
    from rllog.run import load_run_info

    info, data = load_run_info(run_dir)
    specs = data.get("sinks", [])
    if only is not None:
        known = {s["name"]: s for s in specs}
        specs = [known.get(n, {"name": n, "backend": n, "options": {}}) for n in only]

    def parent_gone() -> bool:
        return parent_pid is not None and os.getppid() != parent_pid

    followers = []
    for spec in specs:
        def factory(spec=spec):
            return registry.create(spec["backend"], spec.get("options") or {})

        follower = Follower(
            spec["name"],
            factory,
            info,
            follow=follow,
            writer_gone=parent_gone,
            flush_interval=float(data.get("flush_interval", 1.0)),
            retry=RetryPolicy(**data.get("retry", {})),
            on_progress=(lambda seq, name=spec["name"]: on_progress(name, seq)) if on_progress else None,
        )
        followers.append(follower.start())
    orphaned_at = None
    while any(f.thread.is_alive() for f in followers):
        for f in followers:
            f.join(0.2)
        if parent_gone():
            orphaned_at = orphaned_at or time.monotonic()
            if time.monotonic() - orphaned_at > orphan_timeout:
                logging.getLogger("rllog.agent").error("trainer gone and sinks still busy after %.0fs; exiting", orphan_timeout)
                return len([f for f in followers if f.state != CLOSED])
    return len([f for f in followers if f.state != CLOSED])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rllog.agent", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--follow", action="store_true", help="keep delivering while the journal grows, until its end marker")
    parser.add_argument("--parent-pid", type=int, default=None, help="the trainer's pid: when it dies, deliver what is left and close as killed")
    parser.add_argument("--orphan-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    # Delivery is background work: on a machine with few cores the trainer should win the CPU.
    try:
        os.nice(int(os.environ.get("RLLOG_AGENT_NICE", "10")))
    except (OSError, ValueError):
        pass
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    failed = serve(args.run_dir, args.follow, args.parent_pid, orphan_timeout=args.orphan_timeout)
    sys.stdout.flush()
    # os._exit: a tracker's non-daemon thread (or a hung sink) must not keep the agent alive.
    os._exit(EXIT_SINKS_FAILED if failed else 0)


if __name__ == "__main__":
    main()
