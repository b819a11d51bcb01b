"""The live runs of this process, and what ends them from outside the user's code: SIGTERM, a fork, the exit.

SIGTERM. Python runs a signal handler on the main thread, between two steps of whatever that thread was doing, so
the handler must never wait for something that code holds: it would wait for itself. Every lock a run takes on its
callers' threads is a :class:`SignalAwareLock`, which knows whether the main thread is inside it. The handler

- finishes every live run as ``killed`` on another thread (waiting at most :data:`SIGTERM_FINISH_SECONDS` a run,
  plus a margin), then hands the signal to whoever had it before (the default action ends the process);
- when the main thread is inside a run's lock (in ``log``, ``flush``) or inside a run's own ``finish``, only notes
  the signal: the main thread acts on it as it leaves that lock, or that ``finish``;
- ignores a second SIGTERM while it handles the first (the first is passed on at the end).

A forked child gets no run (its ``log`` raises :class:`rllog.errors.ForkedChild`) and the SIGTERM handler it had
before rllog; at the exit, runs the user did not finish are finished.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import weakref
from typing import Any

from rllog.settings import SIGTERM_FINISH_SECONDS, SIGTERM_JOIN_MARGIN_SECONDS

log = logging.getLogger("rllog")

# rllog.run.Run objects (typed Any: this module is imported by rllog.run.run, and imports nothing back)
Run = Any
_live_runs: weakref.WeakSet[Any] = weakref.WeakSet()
_previous_sigterm: Any = None
_handling_sigterm = False
deferred_sigterm: tuple[int, Any] | None = None  # noted while the main thread was inside a run; acted on as it leaves


_main_ident = threading.main_thread().ident  # the thread Python runs signal handlers on (a forked child's is its own)


def _on_main_thread() -> bool:
    return threading.get_ident() == _main_ident


class SignalAwareLock:
    """A run's lock, which the SIGTERM handler (on the main thread) can ask whether the main thread holds.

    ``with lock:`` acts on a SIGTERM noted meanwhile as it leaves, once the main thread is inside no run. The hot
    path (``Run._append``) takes :attr:`raw`, the C lock itself, and does what :func:`after_lock` does as it leaves,
    inline: ``__enter__``/``__exit__`` and a call would add ~0.3 us to ``log``, several percent of its cost.
    """

    __slots__ = ("raw",)

    def __init__(self) -> None:
        # Reentrant only for ``_is_owned``: which thread holds it is set by the C acquire itself, so a SIGTERM
        # landing anywhere (even between the acquire and the next line) reads it right.
        self.raw = threading.RLock()

    def __enter__(self) -> SignalAwareLock:
        self.raw.acquire()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.raw.release()
        after_lock()

    @property
    def main_inside(self) -> bool:
        """Whether the main thread holds it (asked on the main thread: the SIGTERM handler's)."""
        return bool(self.raw._is_owned())  # type: ignore[attr-defined]


def after_lock() -> None:
    """Called as a thread leaves a run's lock: acts on a SIGTERM noted while the main thread was inside."""
    if deferred_sigterm is not None:
        act_on_deferred_sigterm()


def register(run: Run) -> None:
    """``run`` is live: finished on SIGTERM and at the exit, forgotten in a forked child."""
    _live_runs.add(run)
    _install_sigterm_handler()


def forget(run: Run) -> None:
    _live_runs.discard(run)


def live_runs() -> list[Run]:
    return list(_live_runs)


def _after_fork_in_child() -> None:
    """A forked child shares no writer thread with its parent's runs: their log() raises there, and the
    child's exit finishes nothing (the parent does). Each run gets new locks: one that another thread of the
    parent held at the fork would stay held in the child, where no thread will release it."""
    global deferred_sigterm, _main_ident
    _main_ident = threading.get_ident()
    for run in list(_live_runs):
        run._forked = True
        run._lock = SignalAwareLock()
        run._scan_lock = SignalAwareLock()
    _live_runs.clear()
    deferred_sigterm = None
    _restore_sigterm()


def _restore_sigterm() -> None:
    """Give a forked child back the SIGTERM handler it had before rllog: it has no run to finish. A Python-level
    handler also makes SIGTERM miss a process that blocks in C just as the signal lands (the handler runs only
    when the blocking call returns): a ``multiprocessing`` pool worker waiting for a task then never exits, and
    ``Pool.terminate()`` (the end of ``with Pool(...)``) waits forever."""
    try:
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, _previous_sigterm if _previous_sigterm is not None else signal.SIG_DFL)
    except (ValueError, TypeError, OSError):  # not the main thread, or a handler Python cannot set back
        pass


os.register_at_fork(after_in_child=_after_fork_in_child)


def _main_thread_in_run(runs: list[Run]) -> bool:
    """Whether the main thread holds a run's lock, or is inside a run's own ``finish`` (asked on the main thread).

    Waiting for a lock another thread holds is not inside: the handler's worker thread gets the lock when that
    thread lets go, and the main thread never does."""
    me = threading.get_ident()
    return any(run._lock.main_inside or run._scan_lock.main_inside or (run._finisher == me and not run.finished) for run in runs)


def _on_sigterm(signum: int, frame: Any) -> None:
    """Finish every live run as ``killed``, then hand the signal to whoever had it before (see the module's doc)."""
    global deferred_sigterm, _handling_sigterm
    if _handling_sigterm:
        return
    runs = list(_live_runs)
    if _main_thread_in_run(runs):
        deferred_sigterm = (signum, frame)
        return
    _handling_sigterm = True
    try:
        worker = threading.Thread(target=_finish_as_killed, args=(runs,), name="rllog-sigterm", daemon=True)
        worker.start()
        worker.join(SIGTERM_FINISH_SECONDS * len(runs) + SIGTERM_JOIN_MARGIN_SECONDS)
        if worker.is_alive():
            log.error("rllog: finishing the runs on SIGTERM took too long; what is pending stays in their journals")
    finally:
        _handling_sigterm = False
    previous = _previous_sigterm
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:  # the default action: die of SIGTERM, as the sender expects
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _finish_as_killed(runs: list[Run]) -> None:
    for run in runs:
        try:
            run.finish("killed", timeout=SIGTERM_FINISH_SECONDS)
        except Exception as exc:
            log.error("rllog: finishing %s on SIGTERM failed: %s", run.run_dir, exc)


def act_on_deferred_sigterm() -> None:
    """Act on a SIGTERM noted while the main thread was inside a run, once it is inside none."""
    global deferred_sigterm
    if deferred_sigterm is None or not _on_main_thread() or _main_thread_in_run(list(_live_runs)):
        return
    deferred, deferred_sigterm = deferred_sigterm, None
    _on_sigterm(*deferred)


def _install_sigterm_handler() -> None:
    """Chain onto SIGTERM once, from the main thread (signal handlers can only be set there)."""
    global _previous_sigterm
    if not _on_main_thread() or signal.getsignal(signal.SIGTERM) is _on_sigterm:
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_IGN:
        return  # the process chose to survive SIGTERM; so do we
    _previous_sigterm = previous
    signal.signal(signal.SIGTERM, _on_sigterm)


@atexit.register
def _finish_live_runs() -> None:
    """Finish runs the user did not finish: ``failed`` after an uncaught exception, else ``finished``."""
    status = "failed" if getattr(sys, "last_type", None) is not None else "finished"
    for run in list(_live_runs):
        try:
            run.finish(status)
        except Exception as exc:  # at exit there is no caller left to raise to
            log.error("rllog: finishing %s at exit failed: %s", run.run_dir, exc)
