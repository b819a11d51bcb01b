"""The run directory: its files, how a run claims one, and the delivery report read from it.

Layout of ``RUN_DIR``::

    run.json               RunFile: what the run is and which sinks the agent serves (no secrets)
    run.lock               held by the process that writes the journal
    journal/*.rlj          the journal (rllog.journal)
    delivery/<sink>.json   each sink's cursor (rllog.delivery.CursorStore)
    delivery/<sink>.lock   held by whoever delivers to that sink now
    delivery/flush-request the latest flush the trainer asked for (rllog.delivery.request_flush)
    agent.log              the delivery agent's own log
    trackers/<name>.json   the tracker run a backend chose for this run (rllog_backends._conventions)
    parquet/ ...           file-based sinks write below the run directory

Every file, its schema and version: docs/formats.md.

Everything that reads or writes these files lives here or in the module named beside the file, so
the formats have one owner each.
"""

from __future__ import annotations

import html
import json
import os
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rllog import journal
from rllog.errors import RunDirError
from rllog.files import replace_file
from rllog.records import RunInfo
from rllog.settings import RUNS_DIR

RUN_FILE = "run.json"
RUN_FILE_FORMAT = 1
AGENT_LOG = "agent.log"
TRACKERS_DIR = "trackers"  # trackers/<name>.json: the tracker run a backend chose (docs/formats.md)
TRACKER_FILE_RUN_ID = "rllog_run_id"  # the field of trackers/<name>.json naming the rllog run it belongs to
# The fields of trackers/<name>.json that say where a tracker's data is, most telling first; the others name it
# to the tracker (ids, keys) and are shown after them.
LOCATION_FIELDS = (
    "logdir",
    "dir",
    "db",
    "offline_archives",
    "sync",
    "tracking_uri",
    "run_id",
    "url",
    "task_id",
    "offline_directory",
    "project",
    "workspace",
)


@dataclass
class SinkSpec:
    """A sink the agent builds by name: ``registry.create(name, options)``."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunFile:
    """``RUN_DIR/run.json``: the run's identity and what the delivery agent needs (secrets redacted)."""

    project: str
    name: str
    run_id: str
    config: dict[str, Any] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)
    flush_interval: float = 1.0
    retry: dict[str, Any] = field(default_factory=dict)
    sinks: list[SinkSpec] = field(default_factory=list)
    pid: int | None = None
    started: float | None = None
    attempts: list[dict[str, Any]] = field(
        default_factory=list
    )  # {"attempt", "first_seq", "started", "pid"}, one per init/resume
    program: str = ""  # the trainer's sys.argv[0] and arguments (trackers that show a run's command use them)
    args: list[str] = field(default_factory=list)
    # docs/formats.md. A file without the field is format 1 too (format 1 did not require it); a reader
    # meets a later format with the fields it knows and ignores the others.
    format_version: int = RUN_FILE_FORMAT

    def run_info(self, run_dir: str | os.PathLike) -> RunInfo:
        starts = tuple(sorted(a["first_seq"] for a in self.attempts)) or (1,)
        return RunInfo(
            self.project,
            self.name,
            str(Path(run_dir).resolve()),
            self.run_id,
            self.config,
            tuple(self.tags),
            attempt_starts=starts,
            continuing_starts=tuple(sorted(a["first_seq"] for a in self.attempts if a.get("continues"))),
            program=self.program,
            args=tuple(self.args),
        )

    def write(self, run_dir: str | os.PathLike) -> None:
        replace_file(Path(run_dir) / RUN_FILE, json.dumps(asdict(self), indent=1, default=str))

    @classmethod
    def read(cls, run_dir: str | os.PathLike) -> RunFile:
        data = json.loads((Path(run_dir) / RUN_FILE).read_text())
        data["sinks"] = [SinkSpec(s["name"], s.get("options") or {}) for s in data.get("sinks", [])]
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def load_run_info(run_dir: str | os.PathLike) -> tuple[RunInfo, RunFile]:
    """The RunInfo and the run file of an existing run directory."""
    run_file = RunFile.read(run_dir)
    return run_file.run_info(run_dir), run_file


def default_run_dir(name: str | None, run_id: str) -> Path:
    """``$RLLOG_DIR`` (or ``rllog_runs``) ``/<YYYYmmdd-HHMMSS>-<name>-<run_id>``, or ``-<run_id>`` alone without a name."""
    base = RUNS_DIR.get()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return base / (f"{stamp}-{name}-{run_id}" if name else f"{stamp}-{run_id}")


def find_run(run_id: str) -> Path | None:
    """The run directory holding run ``run_id`` under the runs root (``$RLLOG_DIR`` or ``rllog_runs``), if any."""
    base = RUNS_DIR.get()
    for candidate in sorted(base.glob(f"*{run_id}")) if base.is_dir() else []:
        try:
            if RunFile.read(candidate).run_id == run_id:
                return candidate
        except (FileNotFoundError, ValueError, TypeError, KeyError):
            continue
    return None


def holds_run(run_dir: Path) -> bool:
    return (run_dir / RUN_FILE).is_file()


_held_here: set[Path] = set()  # the run directories whose run lock this process holds


class RunLock:
    """Held by the process that writes a run's journal, for as long as it does (released by the OS if it dies)."""

    def __init__(self, run_dir: Path):
        from filelock import FileLock

        self.run_dir = Path(run_dir).resolve()
        self._lock = FileLock(str(run_dir / "run.lock"), thread_local=False)

    def acquire(self, what: str) -> RunLock:
        """Raises:
        RunDirError: this process or another live one holds the run open."""
        from filelock import Timeout

        if self.run_dir in _held_here:
            raise RunDirError(
                f"{what}: a run of this process has it open; finish that run first (run.finish()), or use another run_dir"
            )
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            raise RunDirError(f"{what}: another live process writes this run ({self._lock.lock_file})") from None
        _held_here.add(self.run_dir)
        return self

    def release(self) -> None:
        _held_here.discard(self.run_dir)
        self._lock.release()


def claim(run_dir: Path) -> Path:
    """Make ``run_dir`` this run's, atomically: of two runs claiming one directory, exactly one wins.

    Raises:
        RunDirError: the directory holds a run already (or another run claimed it first), or cannot be created.
    """
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"run_dir {run_dir} is a file, not a directory: pass a directory (new or empty) for the run")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        os.mkdir(journal.journal_dir(run_dir))  # atomic: exactly one of two concurrent claims succeeds
    except FileExistsError:
        raise RunDirError(_taken_message(run_dir)) from None
    except NotADirectoryError as exc:
        raise RunDirError(f"cannot create the run directory {run_dir}: a part of its path is a file ({exc})") from exc
    except OSError as exc:
        raise RunDirError(f"cannot create the run directory {run_dir}: {exc}") from exc
    return run_dir.resolve()


def _taken_message(run_dir: Path) -> str:
    """What to do about a ``run_dir`` that holds a run already."""
    try:
        held = RunFile.read(run_dir)
    except (OSError, ValueError, TypeError, KeyError):
        return f"{run_dir} already holds a run's journal; use a new run_dir"
    return (
        f"{run_dir} already holds run {held.name!r} (id {held.run_id}); continue it with "
        f"rllog.init(run_dir=..., resume='must'), or use a new run_dir"
    )


def tracker_location(run_dir: str | os.PathLike, name: str) -> str | None:
    """Where tracker ``name`` keeps this run's data, as one line (``logdir=... run_id=...``), or None when unknown.

    Read from ``RUN_DIR/trackers/<name>.json`` (what the backend chose), else a folder ``RUN_DIR/<name>`` the sink
    wrote (parquet's store).
    """
    path = Path(run_dir) / TRACKERS_DIR / f"{name}.json"
    try:
        chosen = json.loads(path.read_text())
    except (OSError, ValueError):
        chosen = None
    if isinstance(chosen, dict):
        chosen.pop(TRACKER_FILE_RUN_ID, None)
        fields = [k for k in LOCATION_FIELDS if chosen.get(k) not in (None, "")]
        fields += sorted(k for k in chosen if k not in LOCATION_FIELDS and chosen[k] not in (None, ""))
        if fields:
            return " ".join(f"{k}={_location_value(chosen[k])}" for k in fields)
    own = Path(run_dir) / name
    return str(own) if own.is_dir() else None


def _location_value(value: Any) -> str:
    """A field of a tracker's location as printed: a list (Comet's archives, wandb's tags) comma-separated."""
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def html_table(title: str, rows: dict[str, str]) -> str:
    """A two-column HTML table (a notebook's rich display of a run or a report)."""
    cells = "".join(
        f"<tr><th style='text-align:left'>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows.items()
    )
    return f"<table><caption style='text-align:left'><b>{html.escape(title)}</b></caption>{cells}</table>"


# -- the report ------------------------------------------------------------------------------------


class ReportState:
    """A sink's state in :func:`report` (``SinkReport.state``): not its cursor's state (:class:`SinkState`) nor
    the run status (:data:`rllog.records.RUN_STATUSES`)."""

    DELIVERED = "delivered"  # every record durable in the sink, and the sink closed (or the asked-for seq reached)
    PENDING = "pending"  # records the sink does not hold yet; `rllog replay` delivers them
    FAILED = "failed"  # the cursor says failed or gave_up: its records stay pending


# Module-level names rllog/cli.py reads the states by.
DELIVERED, PENDING, FAILED = ReportState.DELIVERED, ReportState.PENDING, ReportState.FAILED


@dataclass(frozen=True)
class SinkReport:
    """How far one sink got.

    Attributes:
        state: ``delivered`` (everything, and the sink closed), ``pending`` (records not yet durable in the
            sink; ``rllog replay`` delivers them) or ``failed`` (the sink failed; its records are pending).
        delivered: records durable in the sink.
        pending: records in the journal (or never written to it) that the sink does not hold.
        dead_letters: records the sink rejected for good (see ``dead_letter_list``).
    """

    name: str
    state: str
    delivered: int
    pending: int
    error: str | None = None
    dead_letters: int = 0
    dead_letter_list: tuple[dict, ...] = ()
    location: str | None = None  # where the tracker keeps the data (tracker_location)

    def __str__(self) -> str:
        text = f"{self.name}: {self.state} ({self.delivered} delivered, {self.pending} pending"
        if self.dead_letters:
            first = self.dead_letter_list[0] if self.dead_letter_list else {}
            text += f", {self.dead_letters} dead-lettered, first: seq {first.get('seq')} step {first.get('step')}: {first.get('error')}"
        return text + ")" + (f": {self.error}" if self.error else "")

    def line(self) -> str:
        """One line for the terminal: the state and where the data is."""
        return str(self) + (f" -> {self.location}" if self.location else "")

    def __repr__(self) -> str:
        return f"<SinkReport {self.line()}>"


class FinishReport(dict):
    """``Run.finish``'s result: sink name -> :class:`SinkReport`; ``ok`` when every sink holds every record.

    Attributes:
        records: records logged (readable in the journal, plus any the journal could not take).
        unwritten: records the journal writer still held when it had to give up (a disk full until the
            deadline); they are lost, and counted pending for every sink.
        journal_damage: what readers skipped in the journal (damaged bytes, torn tails).
        notes: run-level facts a user must see (the agent kept dying, the disk was full, ...).
    """

    def __init__(
        self,
        *args: Any,
        records: int = 0,
        unwritten: int = 0,
        journal_damage: journal.Damage | None = None,
        notes: list[str] | None = None,
    ):
        super().__init__(*args)
        self.records = records
        self.unwritten = unwritten
        self.journal_damage = journal_damage or journal.Damage()
        self.notes = notes or []

    @property
    def ok(self) -> bool:
        return not self.unwritten and all(r.state == ReportState.DELIVERED and not r.dead_letters for r in self.values())

    def __str__(self) -> str:
        lines = [str(r) for r in self.values()] or ["no sinks"]
        if self.journal_damage:
            lines.append(f"journal: {self.journal_damage.describe()}")
        return "\n".join(lines + self.notes)

    def summary(self, header: str) -> str:
        """``header`` and whether every record arrived, then a line per tracker (state, where its data is) and notes."""
        verdict = "all records delivered" if self.ok else "NOT all records delivered; `rllog replay RUN_DIR` delivers the rest"
        lines = [f"{header}: {self.records} records, {verdict}"]
        lines += [f"rllog:   {r.line()}" for r in self.values()]
        if self.journal_damage:
            lines.append(f"rllog:   journal: {self.journal_damage.describe()}")
        return "\n".join(lines + [f"rllog:   {note}" for note in self.notes])

    def __repr__(self) -> str:
        sinks = ", ".join(f"{r.name}={r.state}" for r in self.values())
        return f"<FinishReport ok={self.ok} records={self.records} {sinks or 'no sinks'}>"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # IPython's plain display
        printer.text(self.summary("rllog finish report"))

    def _repr_html_(self) -> str:
        rows = {r.name: r.line().removeprefix(f"{r.name}: ") for r in self.values()}
        rows["records"] = str(self.records)
        rows.update((f"note {i + 1}", note) for i, note in enumerate(self.notes))
        return html_table(f"rllog finish report: {'ok' if self.ok else 'not all delivered'}", rows)


def report(
    run_dir: str | os.PathLike,
    sink_names: list[str] | None = None,
    *,
    unwritten: int = 0,
    notes: list[str] | None = None,
    cause: str | None = None,
    upto: int | None = None,
    scan: journal.JournalScan | None = None,
) -> FinishReport:
    """Delivery state of every sink of ``run_dir``, from the journal (every frame verified) and the cursors.

    Args:
        unwritten: records the journal writer could not write (they count as pending everywhere).
        notes: run-level facts to show with the report.
        cause: why delivery stopped, when the sinks' own cursors do not say (e.g. the agent kept dying);
            shown for pending sinks instead of the generic deadline message.
        upto: report on the records up to this seq only (``Run.flush``): a sink that holds them all is
            ``delivered`` whether or not it has closed.
        scan: the journal's scan, if the caller keeps one up to date (:class:`rllog.journal.Scanner`).
    """
    from rllog.delivery import CursorStore, SinkState  # the cursor format's owner; not loaded by `import rllog.rundir`

    run_dir = Path(run_dir)
    if scan is None:
        scan = journal.scan(run_dir)
    total = (scan.count_upto(upto) if upto is not None else scan.records) + unwritten
    if sink_names is None:
        sink_names = CursorStore.names(run_dir)
    result = FinishReport(records=total, unwritten=unwritten, journal_damage=scan.damage, notes=list(notes or []))
    for name in sink_names:
        cursor = CursorStore(run_dir, name).load()
        dead = cursor.dead_letter_count
        ahead = len(cursor.ahead) if upto is None else len([a for a in cursor.ahead if a <= upto])
        delivered = max(0, scan.count_upto(cursor.seq if upto is None else min(cursor.seq, upto)) + ahead - dead)
        pending = max(0, total - delivered - dead)
        if cursor.state in SinkState.BROKEN:
            state = ReportState.FAILED
        elif pending == 0 and (cursor.state == SinkState.CLOSED or upto is not None):
            state = ReportState.DELIVERED
        else:
            state = ReportState.PENDING
        error = cursor.error
        if error is None and state == ReportState.PENDING:
            error = cause or "not delivered before the deadline; run `rllog replay`"
        result[name] = SinkReport(
            name, state, delivered, pending, error, dead, tuple(cursor.dead_letters), tracker_location(run_dir, name)
        )
    return result


def table_dir_name(name: str) -> str:
    """A table name as a directory name, one-to-one: percent-encoding of everything but letters, digits and
    ``_.-~`` (and of a leading dot)."""
    encoded = urllib.parse.quote(name, safe="")
    return "%2E" + encoded[1:] if encoded.startswith(".") else encoded
