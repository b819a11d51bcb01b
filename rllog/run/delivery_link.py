"""The trainer's one link to the delivery side: start the agent process or in-process followers, ask them to
flush, and read how far each sink got.

Every other module of the trainer side (``rllog/run``, ``rllog/validate``, the integrations) imports no part of
:mod:`rllog.delivery` or :mod:`rllog.agent` (``tests/test_layering.py``); this module does, inside its functions,
so that ``import rllog`` stays light and a trainer that never starts a run loads neither.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rllog.records import RunInfo


def default_retry() -> Any:
    """The retry policy of a run that names none (:class:`rllog.delivery.RetryPolicy`)."""
    from rllog.delivery import RetryPolicy

    return RetryPolicy()


def start_agent(
    run_dir: Path,
    options: Mapping[str, Mapping[str, Any]],
    sink_names: list[str],
    system_interval: float | None,
    on_system: Callable[[dict[str, Any]], None],
) -> Any:
    """The delivery agent process for the sinks named, started (:class:`rllog.agent.AgentProcess`)."""
    from rllog.agent import AgentProcess
    from rllog.delivery import forget_finish_deadline

    forget_finish_deadline(run_dir)  # an earlier attempt's finish, in this same process, is not this one's

    return AgentProcess(
        run_dir,
        {n: dict(options.get(n, {})) for n in sink_names},
        sink_names=sink_names,
        system_interval=system_interval,
        on_system=on_system,
    ).start()


def prepare_standby(sink_names: list[str], system_interval: float | None) -> bool:
    """Start a standby agent for these sinks (:func:`rllog.agent.prepare`); whether one is now waiting."""
    from rllog import agent

    return agent.prepare(sink_names, system_interval) is not None


def waiting_standby() -> Any:
    """The standby agent :func:`prepare_standby` left waiting for this process (None when there is none)."""
    from rllog import agent

    return agent.waiting_standby()


def release_standby(standby: Any) -> None:
    """Stop ``standby`` unless a run has taken it (its owner was collected without training)."""
    from rllog import agent

    agent.release_standby(standby)


def follower(name: str, sink: Any, info: RunInfo, flush_interval: float, retry: Any) -> Any:
    """A follower thread (not started) delivering the live journal to ``sink``: an object, or a factory of one."""
    from rllog.delivery import Follower, live_poll_interval

    return Follower(
        name,
        sink,
        info,
        follow=True,
        flush_interval=flush_interval,
        poll_interval=live_poll_interval(flush_interval),
        retry=retry,
    )


def sink_factory(name: str, options: Mapping[str, Any] | None) -> Callable[[], Any]:
    """Builds the sink ``name`` in the thread that delivers to it (a tracker is imported there, not here)."""
    from rllog import registry

    return lambda: registry.create(name, dict(options or {}))


def wait_flushed(run_dir: Path, sink_names: list[str], target: int, deadline: float) -> bool:
    """Wait until every sink's cursor is at ``target`` or past it, or the sink is failed (a failed sink is not
    waited for), or the monotonic ``deadline`` (:func:`rllog.delivery.wait_flushed`); True when none is behind."""
    from rllog.delivery import wait_flushed as wait

    return wait(run_dir, sink_names, target, deadline)


def acknowledged_seq(run_dir: Path) -> int:
    """The highest seq any sink's cursor has passed (0 when none has)."""
    from rllog.delivery import CursorStore

    last = 0
    for name in CursorStore.names(run_dir):
        cursor = CursorStore(run_dir, name).load()
        last = max(last, cursor.seq, *cursor.ahead)
    return last


def tell_finish_deadline(run_dir: Path, deadline: float) -> None:
    """Tell the agent when ``finish`` stops waiting (:func:`rllog.delivery.tell_finish_deadline`): a sink whose next
    try comes after it is stopped at once. A deadline that cannot be written (a full disk) is only not told."""
    from rllog.delivery import tell_finish_deadline as tell

    try:
        tell(run_dir, deadline)
    except OSError:
        pass


def ask_flush(run_dir: Path, target: int, soon: bool, agent: Any = None) -> None:
    """Write the flush request the followers act on (:func:`rllog.delivery.request_flush`) and wake ``agent``'s
    flush watcher (the agent process, when there is one) to read it.

    Raises:
        OSError: the request could not be written (a full disk).
    """
    from rllog.delivery import request_flush

    request_flush(run_dir, target, soon=soon, wake=agent.wake_flush_watcher if agent is not None else None)
