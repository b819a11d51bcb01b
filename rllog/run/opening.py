"""Opening a run: ``init``'s arguments checked, the run directory claimed (or an earlier run's taken over to resume
it), and what the run records about itself (its attempts, the trainer's program).

Nothing here logs a record; :class:`rllog.run.Run` calls :func:`open_run_dir` once, before it starts its journal
writer and its delivery.
"""

from __future__ import annotations

import difflib
import inspect
import math
import os
import secrets
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rllog import journal, settings
from rllog.errors import InvalidArgument, RunDirError, UnknownArgument
from rllog.records import RunInfo
from rllog.registry import parse_report_to
from rllog.run import delivery_link
from rllog.rundir import RunFile, RunLock, claim, default_run_dir, find_run, holds_run
from rllog.settings import SYSTEM_METRICS_INTERVAL
from rllog.validate import redact_args

# "continue": as "must", for a run finished cleanly and reopened by the same trainer (a later evaluate() or
# Lightning stage): the attempt carries on from where the run stopped, so it supersedes nothing of the earlier ones.
RESUME_MODES = ("allow", "must", "never", "continue")
SYSTEM_METRICS_ENV = settings.SYSTEM_METRICS.name
# How alike an unknown argument's name must be to a real one to be suggested (difflib's ratio, 0 to 1).
ARGUMENT_SUGGESTION_CUTOFF = 0.6
# Arguments of other trackers' init that users bring along, and where they go here.
FOREIGN_ARGUMENTS = {
    "entity": "a tracker's own option: backend_options={'wandb': {'entity': ...}}",
    "id": "did you mean 'run_id'?",
    "dir": "did you mean 'run_dir'?",
    "experiment_name": "did you mean 'project'?",
}


def check_arguments(given: Mapping[str, Any], *accepting: Callable[..., Any], what: str = "rllog.init") -> None:
    """Raise for an argument none of ``accepting`` takes, naming the arguments they do and the closest one.

    Raises:
        UnknownArgument: a keyword no signature of ``accepting`` has a parameter for.
    """
    names = list(
        dict.fromkeys(
            p.name
            for function in accepting
            for p in inspect.signature(function).parameters.values()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"
        )
    )
    for key in given:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1, cutoff=ARGUMENT_SUGGESTION_CUTOFF)
            hint = FOREIGN_ARGUMENTS.get(key) or (f"did you mean {close[0]!r}?" if close else "")
            hint = f" ({hint})" if hint else ""
            raise UnknownArgument(f"{what}() got an unknown argument {key!r}{hint}; it takes {', '.join(names)}")


def system_interval(system_metrics: bool | float | None) -> float | None:
    """Seconds between samples of the trainer's system metrics, or None for none (``None``: ``$RLLOG_SYSTEM_METRICS``).

    Raises:
        InvalidArgument: ``system_metrics`` is not a switch or an interval.
        InvalidSetting: ``$RLLOG_SYSTEM_METRICS`` is not one either.
    """
    if system_metrics is None:
        system_metrics = settings.SYSTEM_METRICS.get()
    if system_metrics is True:
        return SYSTEM_METRICS_INTERVAL
    if system_metrics is False or system_metrics is None:
        return None
    if isinstance(system_metrics, (int, float)) and math.isfinite(system_metrics) and system_metrics > 0:
        return float(system_metrics)
    raise InvalidArgument(f"system_metrics must be True, False or a sampling interval in seconds, got {system_metrics!r}")


def check_resume(resume: Any, run_id: Any) -> str:
    """``None`` is ``"never"``, unless a ``run_id`` is given: naming a run's id means continuing it if it exists."""
    if resume is None:
        resume = "allow" if run_id is not None else "never"
    if resume not in RESUME_MODES:
        raise InvalidArgument(f"resume must be one of {RESUME_MODES} (or None), got {resume!r}")
    if run_id is not None and (not isinstance(run_id, str) or not run_id or not all(c.isalnum() or c in "-_." for c in run_id)):
        raise InvalidArgument(f"run_id must be a non-empty string of letters, digits, '-', '_' and '.', got {run_id!r}")
    return resume


def check_options(flush_interval: Any, max_pending: Any, delivery: Any) -> float:
    if delivery not in ("process", "thread"):
        raise InvalidArgument(f"delivery must be 'process' or 'thread', got {delivery!r}")
    if (
        isinstance(flush_interval, bool)
        or not isinstance(flush_interval, (int, float))
        or not math.isfinite(flush_interval)
        or not 0 < flush_interval <= 3600
    ):
        raise InvalidArgument(f"flush_interval must be a number of seconds in (0, 3600], got {flush_interval!r}")
    if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
        raise InvalidArgument(f"max_pending must be a positive int, got {max_pending!r}")
    return float(flush_interval)


def backend_options(
    options: Mapping[str, Mapping[str, Any]] | None, selected_names: list[str], stacklevel: int = 4
) -> dict[str, dict[str, Any]]:
    """``backend_options`` keyed by each backend's canonical name ("comet" -> "comet_ml"); options for a backend
    that is not selected are dropped with a warning (docs/decisions.md, "Options for a backend not selected").

    Args:
        stacklevel: the warning's, counted from here: it points at the user's ``rllog.init`` call.

    Raises:
        UnknownBackend: a key that names no backend.
    """
    from rllog.registry import resolve

    canonical = {resolve(key).name: dict(value) for key, value in (options or {}).items()}
    unused = sorted(set(canonical) - set(selected_names))
    if unused:
        warnings.warn(
            f"rllog: backend_options for {', '.join(unused)} are not used: report_to selects "
            f"{', '.join(selected_names) or 'no backend by name'}",
            UserWarning,
            stacklevel=stacklevel,
        )
    return {name: value for name, value in canonical.items() if name in selected_names}


def agent_interval(delivery: str, system_metrics: bool | float | None) -> float | None:
    """With ``delivery="process"``: the agent's settings checked, before the run directory is claimed (a bad one
    is ``init``'s error, not an agent that cannot start), and its interval between system samples (None: none)."""
    if delivery != "process":
        return None
    interval = system_interval(system_metrics)
    settings.check_agent_settings()
    return interval


@dataclass(frozen=True)
class SelectedSinks:
    """``report_to`` parsed. Names go to the agent process (or to follower threads); sink objects are always
    delivered in-process."""

    selected: list[Any]  # names and objects, in the order given
    named: list[str]
    objects: list[Any]
    options: dict[str, dict[str, Any]]  # backend_options of the named backends, by canonical name


# From backend_options up to the user's rllog.init call: select_sinks, Run.__init__, rllog.init, the user.
SELECT_SINKS_WARNING_STACKLEVEL = 5


def select_sinks(report_to: Any, options: Mapping[str, Mapping[str, Any]] | None) -> SelectedSinks:
    """The sinks ``report_to`` selects, and ``backend_options`` matched to the named ones.

    Raises:
        UnknownBackend: ``report_to`` or a ``backend_options`` key names no backend.
    """
    selected = parse_report_to(report_to)
    named = [s for s in selected if isinstance(s, str)]
    objects = [s for s in selected if not isinstance(s, str)]
    return SelectedSinks(selected, named, objects, backend_options(options, named, SELECT_SINKS_WARNING_STACKLEVEL))


@dataclass
class OpenedRunDir:
    """A run directory this process now holds (its run lock taken), new or resumed."""

    run_dir: Path
    lock: RunLock
    resumed: bool
    project: str
    name: str | None
    run_id: str
    tags: tuple[str, ...]
    config: dict[str, Any]
    attempts: list[dict[str, Any]] = field(default_factory=list)  # the earlier attempts (empty for a new run)
    next_seq: int = 1
    last_step: int = -1


def open_run_dir(
    run_dir: str | os.PathLike | None,
    run_id: str | None,
    resume: str,
    project: str,
    name: str | None,
    tags: tuple[str, ...],
    config: dict[str, Any],
) -> OpenedRunDir:
    """Claim a new run directory, or take over the existing one to resume its run (``resume`` is checked).

    Raises:
        RunDirError: no run to resume where ``resume`` asks for one; the directory is another run's, a file,
            open in this process, or written by another live process.
    """
    given = Path(run_dir) if run_dir is not None else None
    existing = given if given is not None and holds_run(given) else (find_run(run_id) if run_id and given is None else None)
    resumed = existing is not None and resume != "never"
    if resume in ("must", "continue") and not resumed:
        where = f"run_dir {given}" if given is not None else f"run_id {run_id}"
        raise RunDirError(f"resume={resume!r} but there is no run to resume ({where})")
    if not resumed:
        run_id = run_id or secrets.token_hex(8)
        path = claim(given if given is not None else default_run_dir(name, run_id))
        lock = RunLock(path).acquire(f"cannot start a run in {path}")
        return OpenedRunDir(path, lock, False, project, name, run_id, tags, config)
    assert existing is not None
    path = existing.resolve()
    lock = RunLock(path).acquire(f"cannot resume {path}")
    previous = RunFile.read(path)
    if run_id is not None and run_id != previous.run_id:
        lock.release()
        raise RunDirError(f"{path} holds run {previous.run_id!r}, not {run_id!r}")
    attempts = list(previous.attempts) or [{"attempt": 1, "first_seq": 1, "started": previous.started, "pid": previous.pid}]
    return OpenedRunDir(
        path,
        lock,
        True,
        previous.project,
        previous.name,
        previous.run_id,
        tags or tuple(previous.tags),
        {**previous.config, **config},
        attempts,
        next_seq=_resumed_first_seq(path),
        last_step=journal.last_step(path),
    )


def new_attempt(attempts: list[dict[str, Any]], first_seq: int, continues: bool) -> list[dict[str, Any]]:
    """The run's attempts with this one added (``continues``: it supersedes nothing of the earlier ones)."""
    attempt = {"attempt": len(attempts) + 1, "first_seq": first_seq, "started": time.time(), "pid": os.getpid()}
    if continues:
        attempt["continues"] = True
    return [*attempts, attempt]


def run_info(opened: OpenedRunDir, attempts: list[dict[str, Any]]) -> RunInfo:
    """What every sink is told about the run: its identity, config, attempts and the trainer's command line."""
    return RunInfo(
        opened.project,
        opened.name or f"run-{opened.run_id}",
        str(opened.run_dir),
        opened.run_id,
        opened.config,
        opened.tags,
        attempt_starts=tuple(a["first_seq"] for a in attempts),
        continuing_starts=tuple(a["first_seq"] for a in attempts if a.get("continues")),
        program=program(),
        args=redact_args(sys.argv[1:]),
    )


def _resumed_first_seq(run_dir: Path) -> int:
    """The first seq of a resumed attempt: past every record the journal holds and every one a sink's cursor has
    passed. A delivered last frame damaged since (bit rot, a power cut after the agent read it from the page cache)
    is not readable, so counting readable frames alone would give its seq to the attempt's first record, which every
    sink would then skip as delivered."""
    return max(journal.scan(run_dir).last_seq, delivery_link.acknowledged_seq(run_dir)) + 1


def program() -> str:
    """The trainer's program as a user would name it: the script, or ``-m module`` / ``-c``."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        return f"-m {spec.name.removesuffix('.__main__')}"
    return sys.argv[0] if sys.argv and sys.argv[0] else "<python>"


def health_monitor(health: Any) -> Any:
    """``True``: the default rules; ``False``/None: none; a dict: ``HealthMonitor(**health)``; else a monitor object."""
    if health is False or health is None:
        return None
    if health is True or isinstance(health, Mapping):
        from rllog.health import HealthMonitor

        return HealthMonitor(**(health if isinstance(health, Mapping) else {}))
    return health
