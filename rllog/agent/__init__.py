"""The delivery agent: ``python -m rllog.agent RUN_DIR --follow``, and :class:`AgentProcess`, which runs it.

The agent imports and opens the trackers named in ``RUN_DIR/run.json`` and runs one
:class:`rllog.delivery.Follower` thread per sink. It exits when every follower has seen the journal's end marker
and closed its sink. If the trainer dies without ``finish``, the followers deliver what the journal holds and close
their sinks with status ``killed``.

=========================  ==========================================================================================
``rllog.agent.process``    :class:`AgentProcess` (in the trainer: spawn, watch, restart with :class:`RestartBudget`,
                           say on stderr when a sink fails, stop at ``finish``'s deadline)
``rllog.agent.launch``     the agent's command line as the trainer starts it, and its exit codes
``rllog.agent.standby``    the standby pool: :func:`prepare`, :class:`Standby`, :func:`take_standby`
``rllog.agent.placement``  CPU affinity and priority (:class:`PriorityGovernor`, :func:`agent_cpus`), GC freeze
                           (:class:`StartupHeap`)
``rllog.agent.serve``      :func:`serve`: the followers of one run, in the agent
``rllog.agent.cli``        :func:`main`, run by ``python -m rllog.agent`` (``__main__.py``)
=========================  ==========================================================================================

The names below are this package's public API; import them from ``rllog.agent``.
"""

from rllog.agent.cli import main
from rllog.agent.launch import EXIT_RESTART, EXIT_SINKS_FAILED, OPTIONS_FROM_STDIN, STANDBY_ARG
from rllog.agent.placement import (
    CPUS_ENV,
    FROZEN_STATES,
    PRIORITY_ENV,
    PriorityGovernor,
    StartupHeap,
    agent_cpus,
    place,
    process_state,
    trainer_cpu,
)
from rllog.agent.process import AgentProcess, RestartBudget
from rllog.agent.serve import RestartAgent, serve
from rllog.agent.standby import Standby, discard_standby, prepare, release_standby, standby_key, take_standby, waiting_standby

__all__ = [
    "CPUS_ENV",
    "EXIT_RESTART",
    "EXIT_SINKS_FAILED",
    "FROZEN_STATES",
    "OPTIONS_FROM_STDIN",
    "PRIORITY_ENV",
    "STANDBY_ARG",
    "AgentProcess",
    "PriorityGovernor",
    "RestartAgent",
    "RestartBudget",
    "Standby",
    "StartupHeap",
    "agent_cpus",
    "discard_standby",
    "main",
    "place",
    "prepare",
    "process_state",
    "release_standby",
    "serve",
    "standby_key",
    "take_standby",
    "trainer_cpu",
    "waiting_standby",
]
