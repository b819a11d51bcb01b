"""``python -m rllog.agent``: the agent's command line (:func:`main`), a standby's wait for its run included."""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import signal
import sys
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Any, NoReturn

from rllog import settings
from rllog.agent.launch import EXIT_RESTART, EXIT_SINKS_FAILED, OPTIONS_FROM_STDIN, STANDBY_ARG
from rllog.agent.placement import ImportGate, StartupHeap, TrainerLoad, agent_cpus, leave_idle, lower_priority, place
from rllog.agent.serve import RestartAgent, serve
from rllog.rundir import AGENT_LOG
from rllog.settings import ORPHAN_TIMEOUT_SECONDS, SYSTEM_METRICS_INTERVAL
from rllog.sink import CONSOLE_FD_ENV


def _arrow_without_pandas() -> None:
    """pyarrow's first array asks whether pandas is installed by importing it: ~0.4 s of CPU, more than the rest of
    a parquet-only agent's work in a short run, and nothing in the agent hands pandas objects to pyarrow. Only that
    first question is answered "no": a call that needs pandas (``to_pandas``) makes pyarrow import it then."""
    if "pandas" in sys.modules:
        return
    import pyarrow as pa

    class NoPandas:
        @staticmethod
        def find_spec(name: str, *args: Any) -> None:
            if name.partition(".")[0] == "pandas":
                raise ImportError("not for pyarrow's first look (rllog.agent)")

    sys.meta_path.insert(0, NoPandas)
    try:
        pa.array([0.0])
    finally:
        sys.meta_path.remove(NoPandas)


def _exit(code: int) -> NoReturn:
    """End the agent now: ``os._exit``, so that a tracker's non-daemon thread (or a hung sink) cannot keep it alive.

    The interpreter's own exit would also have removed the temporary directories trackers make when imported (wandb:
    ``wandb-media`` and ``wandb-artifacts``); ``os._exit`` skips that, and every agent left them in the temp dir.
    Their finalizers are run here, and only theirs: the trackers' other exit work is what must not hold the agent.
    """
    cleanup = tempfile.TemporaryDirectory._cleanup.__func__  # type: ignore[attr-defined]
    for finalizer in list(getattr(weakref.finalize, "_registry", {})):  # what the interpreter's exit runs
        held = finalizer.peek()
        if held is not None and getattr(held[1], "__func__", None) is cleanup:
            try:
                finalizer()
            except Exception:  # a directory already gone, or not ours to remove: nothing to report at exit
                pass
    os._exit(code)


def _watch_stdin(load: TrainerLoad) -> None:
    """What a standby's stdin says while it imports. Its run arrives as the trainer starts to train: the trainer's
    CPU use is read afresh (:meth:`TrainerLoad.restart`). A trainer that goes without training (stdin closed, nothing
    sent) is not waited for: the standby reaches the end of its stdin, and exits, without waiting up to
    ``RLLOG_AGENT_LAG_MAX`` first."""
    poller = select.poll()
    poller.register(sys.stdin.fileno(), select.POLLIN | select.POLLHUP)
    while True:
        events = dict(poller.poll(1000))
        if not events:
            continue
        if events[sys.stdin.fileno()] & select.POLLIN:
            load.restart()
        else:  # closed with nothing to read
            load.stop()
        return  # the main thread reads the run once its imports are done


def _wait_for_run(args: argparse.Namespace) -> dict[str, Any]:
    """A standby's life before its run: import the trackers at idle priority, then read the run from stdin
    (exit quietly on end of file: the trainer went without training)."""
    from rllog import delivery, registry, rundir  # noqa: F401  (what serve() needs, imported ahead too)

    lower_priority(idle=settings.AGENT_PRIORITY.get() == "idle")  # only cycles the trainer leaves
    place(agent_cpus(os.getppid()))
    load = TrainerLoad.from_settings(os.getppid())
    threading.Thread(target=_watch_stdin, args=(load,), name="rllog-standby-stdin", daemon=True).start()
    with ImportGate(load.start()):  # SCHED_IDLE alone still took a core from a CPU-bound trainer (TrainerLoad)
        for name in filter(None, args.sinks.split(",")):
            load.wait(threading.Event())
            try:
                registry.resolve(name).prepare()
            except Exception as exc:  # the run's agent will meet (and report) the same problem when it opens the sink
                print(f"rllog: preparing {name!r} failed: {type(exc).__name__}: {exc}", flush=True)
    line = sys.stdin.readline()
    log_path = Path(args.standby_log) if args.standby_log else None
    if not line.strip():
        if log_path is not None:
            log_path.unlink(missing_ok=True)
        _exit(0)
    assignment = json.loads(line)
    # The trainer's environment and directory as they are now (they may have changed since the standby started).
    console = os.environ.get(CONSOLE_FD_ENV)
    os.environ.clear()
    os.environ.update(assignment.get("env", {}))
    if console is not None:
        os.environ[CONSOLE_FD_ENV] = console
    os.chdir(assignment.get("cwd", os.getcwd()))
    run_log = Path(assignment["run_dir"]) / AGENT_LOG
    sys.stdout.flush()
    sys.stderr.flush()
    with open(run_log, "ab") as out:
        if log_path is not None:
            out.write(log_path.read_bytes())
            out.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    if log_path is not None:
        log_path.unlink(missing_ok=True)
    leave_idle(0)  # the PriorityGovernor decides from now on (its own thread must not be idle)
    return assignment


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rllog.agent", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("run_dir", nargs="?", help="the run to deliver (a standby reads it from stdin)")
    parser.add_argument("--follow", action="store_true", help="keep delivering while the journal grows, until its end marker")
    parser.add_argument(
        "--parent-pid", type=int, default=None, help="the trainer's pid: when it dies, deliver what is left and close as killed"
    )
    parser.add_argument("--orphan-timeout", type=float, default=ORPHAN_TIMEOUT_SECONDS)
    parser.add_argument(
        OPTIONS_FROM_STDIN,
        action="store_true",
        help="read the sinks' options (one JSON line) from standard input, then flush wake-ups",
    )
    parser.add_argument(
        STANDBY_ARG,
        action="store_true",
        help="import the --sinks' trackers now, then read the run (run_dir, options) as one JSON line from standard input",
    )
    parser.add_argument("--sinks", default="", help="with --standby: the backends to prepare, comma-separated")
    parser.add_argument("--standby-log", default=None, help="with --standby: the output before the run, moved into its agent.log")
    parser.add_argument(
        "--system-metrics-fd", type=int, default=None, help="write samples of the trainer (--parent-pid) to this pipe"
    )
    parser.add_argument("--system-interval", type=float, default=SYSTEM_METRICS_INTERVAL)
    args = parser.parse_args(argv)
    if args.follow or args.standby:
        # The agent's process group is orphaned when its trainer dies; Linux then sends the group SIGHUP and SIGCONT
        # if one of it is stopped (SIGSTOP, a debugger). The SIGCONT lets a stopped agent deliver what its trainer
        # left; the SIGHUP would kill it first (AGENT_PROCESS_GROUP: in a session of its own, the group was orphaned
        # from the start).
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    _arrow_without_pandas()
    heap = StartupHeap.pause() if args.follow or args.standby else None
    if args.standby:
        assignment = _wait_for_run(args)
        args.run_dir, options = assignment["run_dir"], assignment.get("options")
    elif args.run_dir is None:
        parser.error("run_dir is required (or --standby)")
    if args.system_metrics_fd is not None and args.parent_pid is not None:
        from rllog.system_metrics import run_sampler

        run_sampler(args.parent_pid, args.system_metrics_fd, args.system_interval, threading.Event())
    if not args.standby:
        # One line (AgentProcess): the pipe stays open and then carries the trainer's flush wake-ups.
        options = json.loads(sys.stdin.readline() or "{}") if args.options_stdin else None
        lower_priority(idle=False)
    # The trainer's flush wake-ups come down stdin after the options (rllog.delivery.FlushWatcher).
    wakeups = sys.stdin.fileno() if args.standby or args.options_stdin else None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        failed = serve(
            args.run_dir,
            args.follow,
            args.parent_pid,
            orphan_timeout=args.orphan_timeout,
            options=options,
            heap=heap,
            wakeups=wakeups,
        )
    except RestartAgent as exc:
        print(f"rllog: restarting the delivery agent: {exc}", flush=True)
        _exit(EXIT_RESTART)
    sys.stdout.flush()
    _exit(EXIT_SINKS_FAILED if failed else 0)
