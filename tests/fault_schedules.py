"""A fault-schedule explorer: real runs with real faults at random points, checked against docs/guarantees.md.

A schedule is made from a seed (:func:`generate`): how many records a trainer logs, its ``flush_interval``, and
faults at record indexes, each a point (``at``) or a window (``at`` .. ``until``; ``until=None``: past ``finish``).
:func:`run_schedule` runs it for real: a trainer SUBPROCESS (:data:`TRAINER`) logs to ``parquet``, ``tensorboard``
and the test entry-point sink ``jsonl`` (tests/plugins/rllog_test_backends.py, ``scripted`` mode) with a run
directory on a real small tmpfs, and applies each fault itself when it reaches the fault's record index:

- ``disk_full``: the tmpfs filled by a ballast file (leaving ``arg`` bytes), freed when the window ends;
- ``agent_kill``: SIGKILL to the delivery agent; ``agent_stop``: SIGSTOP, SIGCONT when the window ends;
- ``sink_down`` / ``sink_crash``: the jsonl sink raises ``TransientError`` / ``RuntimeError`` (transient and
  permanent sink errors); ``sink_memory`` / ``sink_emfile``: it raises ``MemoryError`` / ``OSError(EMFILE)``;
- ``sink_hang``: every call of the jsonl sink blocks until the window ends (a tracker that stops answering);
- ``sink_rate_limited``: the jsonl sink raises ``RateLimited(retry_after=arg)`` (an HTTP 429; ``arg`` None: no
  ``Retry-After``; 2.5e11: a ``Retry-After`` date in the year 9999);
- ``agent_nofile`` / ``agent_memory``: the agent's real ``RLIMIT_NOFILE`` / ``RLIMIT_AS`` lowered (prlimit) to
  ``arg`` above what it uses, restored when the window ends;
- ``trainer_nofile``: the trainer's own ``RLIMIT_NOFILE`` lowered to ``arg`` above what it uses (a training script
  that leaks descriptors: its journal writer and agent supervisor run out too), restored when the window ends;
- ``trainer_memory``: the trainer's own ``RLIMIT_AS`` lowered to ``arg`` MiB above what it maps (a training script
  that holds almost all memory: rllog's threads, a restarted agent and ``log`` itself run short), restored when the
  window ends; a ``log`` that raises ``MemoryError`` is called again, as a script that survives it would (a record
  must then be in the journal once);
- ``stderr_gone``: the trainer's stderr (descriptor 2) made a pipe whose reader has gone, so every write to it fails
  with ``EPIPE`` (``python train.py 2>&1 | head``, a log collector that died), given back when the window ends;
- ``trainer_stop``: the trainer SIGSTOPs itself (a debugger's breakpoint, a suspended laptop, a frozen cgroup) for
  ``arg`` seconds, a helper process SIGCONTs it;
- ``trainer_kill``: the trainer SIGKILLs itself (the schedule ends there; the agent finishes on its own);
- ``journal_damage``: one byte of a complete journal frame flipped in place (``arg``: ``payload`` or ``seq``);
- ``clock_jump``: the trainer's ``time.time`` shifted by ``arg`` seconds (-1 h, +1 day) for the window.

Then it checks the invariants (:data:`INVARIANTS`) against what the trainer printed as logged, the journal
(``rllog.journal.read_all``: the truth for what was logged and journaled), the report, and each sink's own
storage; runs ``rllog replay RUN_DIR --to NAME`` (the CLI) for every sink left with pending records, checks
again, and replays once more to check that nothing is sent twice. :func:`shrink` deletes faults and halves the
run while a violation persists. Used by tests/test_explorer.py and benchmarks/soak.py.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from sinks import mounted_tmpfs

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = ROOT / "tests" / "plugins"
TESTS = ROOT / "tests"

SINKS = ("parquet", "tensorboard", "jsonl")
JSONL = "jsonl"
TABLE_NAMES = (1, 3, 40)  # how many table names a schedule logs to (the parquet sink keeps a file open per name)
DISK_MB = (8, 8, 4)  # the tmpfs: room for a schedule's data (journal, parquet, TensorBoard: 0.5-5 MB), or barely
WIDTHS = (3, 3, 20)  # metrics per record (20: the record, whose derived stores outgrow the journal)
LOW_SPACE = 512 * 1024  # free bytes at the end below which the run's own data filled the disk (nothing to blame)
RECORDS_RANGE = (600, 2400)  # records per schedule: a few seconds of logging at PACE
PACE = 0.003  # seconds the trainer sleeps per record (in steps of 10 records): faults land while records flow
FLUSH_INTERVALS = (0.05, 0.1, 0.2, 0.5)
FINISH_TIMEOUT = 20.0  # finish's deadline: a sink still down then is reported pending, and replayed
TRAINER_TIMEOUT = 240.0  # a trainer running longer hangs (log blocked, finish past its deadline)
AGENT_EXIT_TIMEOUT = 120.0  # after its trainer died, the agent delivers what the journal holds and exits
REPLAY_TIMEOUT = 180.0
MAX_FAULTS = 6
HEADROOMS = (0, 16 * 1024, 150 * 1024)  # bytes a full disk leaves free: none, less than a flush, the 150 KB
CLOCK_JUMPS = (-3600.0, 86400.0)
TRAINER_STOPS = (0.5, 3.0)  # seconds the trainer stays SIGSTOPped
NOFILE_SPARE = (2, 8)  # descriptors the agent may still open under a lowered RLIMIT_NOFILE
MEMORY_SPARE_MB = (1, 24)  # MiB of address space the agent may still map under a lowered RLIMIT_AS
TRAINER_NOFILE_SPARE = (0, 6)  # descriptors the trainer may still open under its lowered RLIMIT_NOFILE
TRAINER_MEMORY_SPARE_MB = (0, 16)  # MiB of address space the trainer may still map under its lowered RLIMIT_AS
TRAINER_MEMORY_CHANCE = 0.15  # of a schedule having a trainer_memory window (drawn apart: see generate)
# A 429's Retry-After: none given (backoff), short, a second, and an HTTP-date in the year 9999 (2.5e11 s away).
RETRY_AFTERS = (None, 0.05, 1.0, 2.5e11)
SHORT_RETRY_AFTER = 5.0  # a 429 asking for at most this is retried well within finish's deadline once its window ends
# Faults after which every sink must be delivered by finish once they are over (the others may leave a sink failed,
# dead letters, or a retry backoff longer than finish's deadline).
RECOVERABLE = (
    "disk_full",
    "agent_kill",
    "agent_stop",
    "clock_jump",
    "journal_damage",
    "sink_hang",
    "trainer_nofile",
    "trainer_memory",
    "stderr_gone",
    "trainer_stop",
)
DAMAGE_BYTES_PER_FRAME = 4096  # a damaged frame costs its own bytes (a few hundred here): a generous bound
CRASH_MESSAGE = "crashed on purpose"  # the jsonl sink's permanent error (sink_crash), the one cause of a failed sink
RESOURCE_ERRORS = ("MemoryError", "EMFILE", "Too many open files", "ENOMEM", "Cannot allocate memory")

WINDOWS = (
    "disk_full",
    "agent_stop",
    "sink_down",
    "sink_crash",
    "sink_memory",
    "sink_emfile",
    "agent_nofile",
    "agent_memory",
    "clock_jump",
    "sink_hang",
    "sink_rate_limited",
    "trainer_nofile",
    "stderr_gone",
)
POINTS = ("agent_kill", "journal_damage", "trainer_stop", "trainer_kill")
FAULT_KINDS = WINDOWS + POINTS
# Windows drawn from a generator of their own, after the others, so that adding one left the schedule of every seed
# drawn before it as it was (but for the window itself, in TRAINER_MEMORY_CHANCE of them).
DRAWN_APART = ("trainer_memory",)
ALL_KINDS = FAULT_KINDS + DRAWN_APART
SINK_MODES = {
    "sink_down": "down",
    "sink_crash": "crash",
    "sink_memory": "memory",
    "sink_emfile": "emfile",
    "sink_hang": "hang",
    "sink_rate_limited": "rate_limited",
}
# Faults after which the agent may re-send in-flight records (an agent restarted in a trainer_memory window inherits
# its trainer's lowered RLIMIT_AS, and may die of it).
AGENT_DEATHS = ("agent_kill", "agent_memory", "agent_nofile", "trainer_memory")
# A window that may outlast finish (None): a disk full past the deadline, a tracker down or broken for good.
MAY_OUTLAST_FINISH = (
    "disk_full",
    "sink_down",
    "sink_crash",
    "clock_jump",
    "sink_hang",
    "sink_rate_limited",
    "trainer_nofile",
    "stderr_gone",
)

INVARIANTS = {
    "trainer_completed": "the trainer logged every record and finish returned (no hang, no exception)",
    "agent_exited": "after the trainer died, the agent delivered what it could and exited",
    "report_arithmetic": "per sink delivered + pending + dead_letters == records",
    "report_records": "records == readable journal records + unwritten",
    "journal_nothing_invented": "the journal holds only records the trainer logged",
    "journal_complete": "every logged record is in the journal, except the frames damaged, those counted unwritten "
    "and, after a trainer SIGKILL, those logged within flush_interval of it",
    "unwritten_exact": "unwritten == the logged records missing from the journal (not damaged)",
    "sink_nothing_invented": "a sink holds only records the trainer logged",
    "sink_no_duplicate": "no record twice in a sink (TensorBoard excepted; jsonl only after the agent died or hung in "
    "it past finish)",
    "report_delivered_held": "a sink holds at least the records its report calls delivered",
    "missing_is_reported": "the journal records a sink lacks are at most its pending + dead letters",
    "dead_letters_listed": "dead letters are journal records the sink does not hold",
    "resource_error_transient": "no sink failed or dead-lettered a record because of MemoryError/EMFILE",
    "follower_survives": "no uncaught exception ends a thread of the agent (agent.log)",
    "failed_only_for_good": "a sink is reported failed only for an error that is permanent (the jsonl sink's crash): never "
    "for a 429, a transient error or what the machine ran out of",
    "cause_named": "a sink the agent's log says failed is not reported as merely late ('not delivered before the deadline')",
    "damage_only_where_damaged": "the report and every cursor count as damaged at most the frames the schedule damaged "
    "(torn tails only after a trainer SIGKILL)",
    "nothing_lost_when_space_returns": "a disk full and freed before finish loses nothing: unwritten == 0",
    "delivered_after_faults_end": "when the only faults were a disk full and freed, agent SIGKILL/SIGSTOP, clock jumps, "
    "damaged bytes, a sink hung, short 429s, the trainer out of descriptors or its stderr gone, all over before finish, "
    "finish reports every sink delivered",
    "others_unaffected": "when the jsonl sink failed, hung or was rate limited (for good or for a while) and every other "
    "fault was one of those and over before finish, finish reports parquet and TensorBoard delivered",
    "replay_completes": "after `rllog replay`, every sink holds every journal record (dead letters excepted) and "
    "its report says so",
    "replay_no_resend": "a second `rllog replay` sends nothing",
}


@dataclass(frozen=True)
class Fault:
    kind: str
    at: int
    until: int | None = None  # windows only; None: past finish
    arg: float | int | str | None = None

    def describe(self) -> str:
        span = f"@{self.at}" if self.kind in POINTS else f"@{self.at}..{'end' if self.until is None else self.until}"
        return f"{self.kind}{span}" + ("" if self.arg is None else f"({self.arg})")


@dataclass(frozen=True)
class Schedule:
    seed: int
    records: int
    flush_interval: float
    table_every: int  # every table_every-th record is a table (0: none)
    faults: tuple[Fault, ...] = ()
    table_names: int = 1  # tables cycle through names t0, t1, ...
    width: int = 3  # metrics per record
    disk_mb: int = 8  # the tmpfs the run dir is on

    def describe(self) -> str:
        faults = ", ".join(f.describe() for f in self.faults) or "no faults"
        return (
            f"seed {self.seed}: {self.records} records, flush_interval {self.flush_interval}, "
            f"table every {self.table_every or '-'} ({self.table_names} names), {self.width} metrics, "
            f"{self.disk_mb} MB disk; {faults}"
        )

    def as_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        data = json.loads(text)
        return cls(**(data | {"faults": tuple(Fault(**f) for f in data["faults"])}))

    def scaled(self, factor: float) -> Schedule:
        """The same faults on a run ``factor`` times as long (indexes scaled)."""

        def at(i: int | None) -> int | None:
            return None if i is None else max(1, int(i * factor))

        return replace(
            self,
            records=max(50, int(self.records * factor)),
            faults=tuple(replace(f, at=at(f.at) or 1, until=at(f.until)) for f in self.faults),
        )


def generate(seed: int) -> Schedule:
    """The schedule of ``seed`` (the same on every machine)."""
    rng = random.Random(seed)
    n = rng.randint(*RECORDS_RANGE)
    faults: list[Fault] = []
    kill_at = rng.randint(n // 3, n - 1) if rng.random() < 0.2 else None
    last = kill_at if kill_at is not None else n
    for _ in range(rng.randint(1, MAX_FAULTS)):
        kind = rng.choice(FAULT_KINDS[:-1])  # trainer_kill is drawn once, above
        at = rng.randint(1, last - 1)
        if kind in POINTS:
            if kind == "journal_damage":
                at = max(at, min(100, last - 1))  # a few frames must be written to choose from
            point_arg = {"journal_damage": ("payload", "seq"), "trainer_stop": TRAINER_STOPS}.get(kind)
            faults.append(Fault(kind, at, None, rng.choice(point_arg) if point_arg else None))
            continue
        until: int | None = min(last, at + rng.randint(20, max(21, n // 2)))
        if kind in MAY_OUTLAST_FINISH and kill_at is None and rng.random() < 0.2:
            until = None
        arg: float | int | None = None
        if kind == "disk_full":
            arg = rng.choice(HEADROOMS)
        elif kind == "clock_jump":
            arg = rng.choice(CLOCK_JUMPS)
        elif kind == "agent_nofile":
            arg = rng.randint(*NOFILE_SPARE)
        elif kind == "agent_memory":
            arg = rng.randint(*MEMORY_SPARE_MB)
        elif kind == "trainer_nofile":
            arg = rng.randint(*TRAINER_NOFILE_SPARE)
        elif kind == "sink_rate_limited":
            arg = rng.choice(RETRY_AFTERS)
        faults.append(Fault(kind, at, until, arg))
    apart = random.Random(f"trainer_memory {seed}")
    if apart.random() < TRAINER_MEMORY_CHANCE and last > 2:
        at = apart.randint(1, last - 1)
        until = min(last, at + apart.randint(20, max(21, n // 2)))
        faults.append(Fault("trainer_memory", at, until, apart.randint(*TRAINER_MEMORY_SPARE_MB)))
    if kill_at is not None:
        faults.append(Fault("trainer_kill", kill_at))
    faults.sort(key=lambda f: (f.at, f.kind))
    return Schedule(
        seed,
        n,
        rng.choice(FLUSH_INTERVALS),
        rng.choice((0, 7, 50)),
        tuple(faults),
        rng.choice(TABLE_NAMES),
        rng.choice(WIDTHS),
        rng.choice(DISK_MB),
    )


# The trainer: logs the schedule's records and applies its faults itself when their record index comes, so a
# fault lands at the same place in the stream on any machine. Prints "L <index> <monotonic>" per record logged,
# "D <seq> <index>" per damaged frame, "K <monotonic>" before killing itself and "R <report json>" after finish.
TRAINER = r"""
import collections, contextlib, json, os, random, resource, signal, subprocess, sys, time
spec = json.loads(sys.argv[1])
_real_time = time.time
clock = {"offset": 0.0}
time.time = lambda: _real_time() + clock["offset"]  # a clock jump: everything in this process that reads time.time
from pathlib import Path
import rllog
import sinks  # tests/sinks.py
from rllog import journal

out = sys.stdout
rng = random.Random(spec["seed"])
run = rllog.init(report_to=list(spec["sinks"]), run_dir=spec["run_dir"], flush_interval=spec["flush_interval"],
                 health=False, backend_options=spec["backend_options"])
stopped, damaged = set(), set()


class Windows:
    # The open windows of one fault, oldest first. Windows of a kind may overlap: the first to start applies the
    # fault, the last to end undoes it (and what the fault replaced is kept from before the first), and each window
    # keeps what it was started with (a sink's mode: the newest open one's holds until it ends).
    def __init__(self):
        self.open = []

    def opened(self, f, held=None):
        first = not self.open
        self.open.append((window(f), held))
        return first

    def closed(self, f):
        # True when f was the last open window
        was_open = any(w == window(f) for w, _ in self.open)
        self.open = [(w, held) for w, held in self.open if w != window(f)]
        return was_open and not self.open

    def newest(self):
        return self.open[-1][1]


windows = collections.defaultdict(Windows)  # by what the fault changes: "sink", "stderr", "own", or an agent limit's kind
saved = {}  # what a fault replaced, kept until its last window ends: stderr, the trainer's limit, the agents' limits
own = {"lowered": None, "memory": None}  # the trainer's own RLIMIT_NOFILE / RLIMIT_AS while trainer_* windows are open


def agent_pid():
    proc = run._agent.proc
    return proc.pid if proc is not None and proc.poll() is None else None


def set_mode(mode, retry_after=None):
    tmp = spec["control"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"mode": mode, "retry_after": retry_after}, f)
    os.replace(tmp, spec["control"])


@contextlib.contextmanager
def own_limits():
    # The explorer's own fault code (a control file, the ballast, /proc) runs with the trainer's limits as they were;
    # rllog's threads meet the lowered ones the rest of the time.
    if own["lowered"] is not None:
        resource.setrlimit(resource.RLIMIT_NOFILE, saved["own"])
    if own["memory"] is not None:
        resource.setrlimit(resource.RLIMIT_AS, saved["own_memory"])
    try:
        yield
    finally:  # the limits as the call left them: lowered by the first window's start, given back by the last's end
        if own["lowered"] is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, own["lowered"])
        if own["memory"] is not None:
            resource.setrlimit(resource.RLIMIT_AS, own["memory"])


def mapped():
    status = open("/proc/self/status").read()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmSize:"))) * 1024


def again_if_short_of_memory(call):
    # What a script that survives a MemoryError does: call again (the trainer_memory window ends by itself).
    while True:
        try:
            return call()
        except MemoryError:
            memory_errors[0] += 1
            time.sleep(0.005)


memory_errors = [0]


def fill(headroom):
    filler = sinks.fill(Path(spec["ballast"]).parent)  # the disk to its last byte, then headroom given back
    os.truncate(filler, max(0, os.path.getsize(filler) - headroom))


def damage(where):
    segs = journal.segments(journal.journal_dir(spec["run_dir"]))
    frames = []
    for seg in segs:
        data = seg.read_bytes()
        pos = 0
        while pos + journal.HEADER.size <= len(data):
            magic, kind, _, _, seq, length, _, _ = journal.HEADER.unpack_from(data, pos)
            if magic != journal.MAGIC:
                break
            end = pos + journal.HEADER.size + length
            if end > len(data):
                break
            if kind == journal.KIND_METRICS and (str(seg), pos) not in damaged and length > 8:
                frames.append((seg, pos, seq, json.loads(data[pos + journal.HEADER.size:end])["values"]["id"]))
            pos = end
    if not frames:
        return
    seg, pos, seq, ident = rng.choice(frames)
    at = pos + journal.HEADER.size + rng.randrange(2, 8) if where == "payload" else pos + 12
    fd = os.open(seg, os.O_RDWR)  # in place: the writer may be appending to this segment
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x5A]), at)
    finally:
        os.close(fd)
    damaged.add((str(seg), pos))
    out.write(f"D {seq} {int(ident)}\n")


def start(f):
    try:
        apply(f)
    except (ProcessLookupError, FileNotFoundError):  # the agent exited between the look and the signal: no fault
        out.write(f"M {f['kind']} {f['at']}\n")


def window(f):
    return f["kind"], f["at"], f["until"]


def lower_limit(f, pid, which):
    # The limit pid had before the first open window of f's kind lowered it: the last of them to end gives every
    # agent its limit from before the first (a window that saved the limit an earlier one had lowered left the agent
    # without descriptors for the rest of the run: seed 16877).
    if windows[f["kind"]].opened(f):
        saved[f["kind"]] = {}
    agents = saved[f["kind"]]
    if pid not in agents:
        agents[pid] = (which, resource.prlimit(pid, which))
    return agents[pid][1]


def apply(f):
    kind, arg = f["kind"], f["arg"]
    pid = agent_pid()
    if kind == "disk_full":
        fill(int(arg))
    elif kind == "agent_kill" and pid:
        os.kill(pid, signal.SIGKILL)
    elif kind == "agent_stop" and pid:
        os.kill(pid, signal.SIGSTOP)
        stopped.add(pid)
    elif kind in spec["sink_modes"]:
        windows["sink"].opened(f, (spec["sink_modes"][kind], arg))
        set_mode(spec["sink_modes"][kind], arg)
    elif kind == "stderr_gone":
        if windows["stderr"].opened(f):
            saved["stderr"] = os.dup(2)
            read_end, write_end = os.pipe()
            os.close(read_end)  # the reader has gone: a write gets EPIPE (Python ignores SIGPIPE)
            os.dup2(write_end, 2)
            os.close(write_end)
    elif kind == "trainer_nofile":
        if windows["own"].opened(f):
            saved["own"] = resource.getrlimit(resource.RLIMIT_NOFILE)
        own["lowered"] = (len(os.listdir("/proc/self/fd")) + int(arg), saved["own"][1])
    elif kind == "trainer_memory":
        if windows["own_memory"].opened(f):
            saved["own_memory"] = resource.getrlimit(resource.RLIMIT_AS)
        own["memory"] = (mapped() + int(arg) * 1024 * 1024, saved["own_memory"][1])
    elif kind == "agent_nofile" and pid:
        old = lower_limit(f, pid, resource.RLIMIT_NOFILE)
        used = len(os.listdir(f"/proc/{pid}/fd"))
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (used + int(arg), old[1]))
    elif kind == "agent_memory" and pid:
        old = lower_limit(f, pid, resource.RLIMIT_AS)
        status = open(f"/proc/{pid}/status").read()
        vm = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmSize:"))) * 1024
        resource.prlimit(pid, resource.RLIMIT_AS, (vm + int(arg) * 1024 * 1024, old[1]))
    elif kind == "clock_jump":
        clock["offset"] = float(arg)
    elif kind == "journal_damage":
        damage(arg)
    elif kind == "trainer_stop":
        subprocess.Popen(["sh", "-c", f"sleep {arg}; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "trainer_kill":
        for p in stopped:
            os.kill(p, signal.SIGCONT)
        out.write(f"K {time.monotonic()}\n")
        out.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def end(f):
    kind = f["kind"]
    if kind == "disk_full":
        try:
            os.unlink(spec["ballast"])
        except FileNotFoundError:
            pass
    elif kind == "agent_stop":
        for p in stopped:
            try:
                os.kill(p, signal.SIGCONT)
            except ProcessLookupError:
                pass
        stopped.clear()
    elif kind in spec["sink_modes"]:
        if windows["sink"].closed(f):
            set_mode("ok")
        elif windows["sink"].open:  # an overlapped window's mode comes back
            set_mode(*windows["sink"].newest())
    elif kind == "stderr_gone":
        if windows["stderr"].closed(f):
            os.dup2(saved["stderr"], 2)
            os.close(saved.pop("stderr"))
    elif kind == "trainer_nofile":
        if windows["own"].closed(f):
            own["lowered"] = None  # own_limits, around this call, has given the saved limit back
    elif kind == "trainer_memory":
        if windows["own_memory"].closed(f):
            own["memory"] = None
    elif kind in ("agent_nofile", "agent_memory"):
        if windows[kind].closed(f):
            for pid, (which, old) in saved.pop(kind).items():
                try:
                    resource.prlimit(pid, which, old)
                except ProcessLookupError:
                    pass
    elif kind == "clock_jump":
        clock["offset"] = 0.0


faults = spec["faults"]
starts, ends = {}, {}
for f in faults:
    starts.setdefault(f["at"], []).append(f)
    if f["kind"] not in spec["points"] and f["until"] is not None:
        ends.setdefault(f["until"], []).append(f)
n, every = spec["records"], spec["table_every"]
for i in range(n):
    for f in ends.get(i, []):
        with own_limits():
            end(f)
    for f in starts.get(i, []):
        with own_limits():
            start(f)
    if every and i % every == every - 1:
        again_if_short_of_memory(lambda: run.log_table(
            f"t{(i // every) % spec['table_names']}", {"id": [i, i], "text": ["a" * (i % 13), "b"]}, step=i))
    else:
        again_if_short_of_memory(lambda: run.log(
            {"id": float(i), "x": i * 0.5, "y": -1.0} | {f"m{k}": i + k * 0.25 for k in range(spec["width"] - 3)}, step=i))
    again_if_short_of_memory(lambda: out.write(f"L {i} {time.monotonic()}\n"))
    if i % 10 == 9:
        again_if_short_of_memory(out.flush)
        time.sleep(spec["pace"] * 10)  # the trainer's pace, part of the schedule: faults land while it logs
for f in ends.get(n, []):
    with own_limits():
        end(f)
out.flush()
report = run.finish(timeout=spec["finish_timeout"])
sinks = {name: {"state": r.state, "delivered": r.delivered, "pending": r.pending, "dead_letters": r.dead_letters,
                "error": r.error, "dead_letter_list": list(r.dead_letter_list)} for name, r in report.items()}
out.write("R " + json.dumps({"records": report.records, "unwritten": report.unwritten, "ok": report.ok,
                             "damage": report.journal_damage.as_dict(), "notes": report.notes, "sinks": sinks,
                             "restarts": run._agent.restarts if run._agent else 0,
                             "memory_errors": memory_errors[0]}) + "\n")
out.flush()
for f in faults:  # windows that outlast finish end now (a disk full past finish is freed by the explorer)
    if f["kind"] not in spec["points"] and f["until"] is None and f["kind"] != "disk_full":
        end(f)
"""


@dataclass
class Violation:
    invariant: str
    detail: str

    def __str__(self) -> str:
        return f"{self.invariant}: {self.detail}"


@dataclass
class Outcome:
    schedule: Schedule
    violations: list[Violation] = field(default_factory=list)
    checks: collections.Counter = field(default_factory=collections.Counter)
    seconds: float = 0.0

    def check(self, invariant: str, holds: bool, detail: str) -> bool:
        self.checks[invariant] += 1
        if not holds:
            self.violations.append(Violation(invariant, detail))
        return holds

    @property
    def keys(self) -> set[str]:
        return {v.invariant for v in self.violations}


def keep_evidence(run_dir: Path, to: Path) -> None:
    """Copy the agent's log and the cursor files off the tmpfs (unmounted after) for a reader of a failure."""
    to.mkdir(exist_ok=True)
    for path in [run_dir / "agent.log", run_dir / "run.json", *sorted((run_dir / "delivery").glob("*.json"))]:
        with contextlib.suppress(OSError):
            shutil.copyfile(path, to / path.name)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PLUGINS), str(ROOT), str(TESTS), env.get("PYTHONPATH")]))
    env["RLLOG_SYSTEM_METRICS"] = "0"  # samples would add records the schedule did not log
    env.pop("TENSORBOARD_LOGGING_DIR", None)  # TensorBoard writes in the run dir, on the small disk
    for k in list(env):
        if k.startswith("RLLOG_TEST_MODE_"):
            env.pop(k)
    return env


def agent_pids(run_dir: Path) -> list[int]:
    """The delivery agents (or replays) serving ``run_dir``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"rllog.agent" in cmd and str(run_dir).encode() in cmd:
            found.append(int(entry))
    return found


def wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@dataclass
class TrainerLog:
    logged: dict[int, float] = field(default_factory=dict)  # record index -> monotonic time log() returned
    damaged: dict[int, int] = field(default_factory=dict)  # seq -> record index of each damaged frame
    killed_at: float | None = None
    report: dict | None = None


def parse_trainer_output(text: str) -> TrainerLog:
    result = TrainerLog()
    for line in text.splitlines():
        tag, _, rest = line.partition(" ")
        if tag == "L":
            i, t = rest.split()
            result.logged[int(i)] = float(t)
        elif tag == "D":
            seq, i = rest.split()
            result.damaged[int(seq)] = int(i)
        elif tag == "K":
            result.killed_at = float(rest)
        elif tag == "R":
            result.report = json.loads(rest)
    return result


@dataclass
class Held:
    """What one sink holds: record index -> how many times (and lines the reader could not parse)."""

    counts: collections.Counter = field(default_factory=collections.Counter)
    unreadable: int = 0

    @property
    def ids(self) -> set[int]:
        return set(self.counts)

    def doubled(self) -> list[int]:
        return sorted(i for i, c in self.counts.items() if c > 1)


def read_sinks(run_dir: Path, jsonl_file: Path, table_names: int) -> dict[str, Held]:
    from rllog_backends import parquet  # what the sink stored: rllog.read_* reads the journal when parquet fell short

    held = {name: Held() for name in SINKS}
    try:
        metrics = parquet.read_metrics(run_dir, attempts="all")
        for key, value in zip(metrics.column("key").to_pylist(), metrics.column("value").to_pylist(), strict=True):
            if key == "id":
                held["parquet"].counts[int(value)] += 1
    except (FileNotFoundError, KeyError):
        pass
    for j in range(table_names):
        try:
            table = parquet.read_table(run_dir, f"t{j}", attempts="all")
        except (FileNotFoundError, KeyError):
            continue
        rows = collections.Counter(table.column("id").to_pylist())
        for ident, count in rows.items():  # each table record has two rows
            held["parquet"].counts[int(ident)] += count // 2 + count % 2
    if jsonl_file.exists():
        for line in jsonl_file.read_text().splitlines():
            try:
                item = json.loads(line)
            except ValueError:
                held[JSONL].unreadable += 1
                continue
            if "values" in item:
                held[JSONL].counts[int(item["values"]["id"])] += 1
            elif "ids" in item:
                held[JSONL].counts[int(item["ids"][0])] += 1
    held["tensorboard"] = read_tensorboard(run_dir)
    return held


def read_tensorboard(run_dir: Path) -> Held:
    """The steps of TensorBoard's ``id`` scalar (metrics records only: its tables are text), every layer."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    held = Held()
    logdir = run_dir / "tensorboard"
    if not logdir.is_dir():
        return held
    layers = [logdir] + [p for p in logdir.iterdir() if p.is_dir() and p.name.startswith("out_of_order")]
    for layer in layers:
        acc = EventAccumulator(str(layer), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        if "id" in acc.Tags().get("scalars", []):
            for event in acc.Scalars("id"):
                held.counts[int(event.value)] += 1
    return held


def journal_records(run_dir: Path) -> tuple[dict[int, int], set[int]]:
    """Seq -> record index of every readable record in the journal, and the indexes of its table records."""
    import logging

    from rllog import journal
    from rllog.records import MetricsRecord, TableRecord

    by_seq: dict[int, int] = {}
    tables: set[int] = set()
    logger = logging.getLogger("rllog.journal")
    level = logger.level
    logger.setLevel(logging.ERROR)  # the damage this explorer made is expected; its warnings are noise
    try:
        for record in journal.read_all(run_dir):
            if isinstance(record, MetricsRecord):
                by_seq[record.seq] = int(record.values["id"])
            elif isinstance(record, TableRecord):
                by_seq[record.seq] = int(record.table.column("id")[0].as_py())
                tables.add(by_seq[record.seq])
    finally:
        logger.setLevel(level)
    return by_seq, tables


def report_now(run_dir: Path) -> dict:
    """The report as ``rllog show`` computes it after the fact (for a trainer that never reached finish)."""
    from rllog.rundir import report

    r = report(run_dir, list(SINKS))
    return {
        "records": r.records,
        "unwritten": r.unwritten,
        "damage": r.journal_damage.as_dict(),
        "sinks": {
            name: {
                "state": s.state,
                "delivered": s.delivered,
                "pending": s.pending,
                "dead_letters": s.dead_letters,
                "error": s.error,
                "dead_letter_list": list(s.dead_letter_list),
            }
            for name, s in r.items()
        },
    }


def is_resource_error(text: str | None) -> bool:
    return bool(text) and any(word in text for word in RESOURCE_ERRORS)


def run_schedule(schedule: Schedule, workdir: Path) -> Outcome:
    """Run ``schedule`` for real in ``workdir`` (made here; a tmpfs is mounted under it) and check every invariant."""
    outcome = Outcome(schedule)
    began = time.monotonic()
    workdir.mkdir(parents=True, exist_ok=True)
    with mounted_tmpfs(workdir / "disk", f"size={schedule.disk_mb}m") as disk:
        try:
            _run_and_check(schedule, workdir, disk, outcome)
        finally:
            for pid in agent_pids(disk / "run"):  # nothing may outlive the schedule
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            keep_evidence(disk / "run", workdir / "evidence")
    outcome.seconds = time.monotonic() - began
    return outcome


def _run_and_check(schedule: Schedule, workdir: Path, disk: Path, outcome: Outcome) -> None:
    run_dir, ballast = disk / "run", disk / "filler"  # the file tests/sinks.py's fill makes
    jsonl_file, control = workdir / "jsonl.jsonl", workdir / "jsonl.control"
    control.write_text(json.dumps({"mode": "ok"}))
    spec = {
        "seed": schedule.seed,
        "run_dir": str(run_dir),
        "ballast": str(ballast),
        "control": str(control),
        "sinks": SINKS,
        "records": schedule.records,
        "flush_interval": schedule.flush_interval,
        "table_every": schedule.table_every,
        "table_names": schedule.table_names,
        "width": schedule.width,
        "pace": PACE,
        "finish_timeout": FINISH_TIMEOUT,
        "faults": [asdict(f) for f in schedule.faults],
        "points": POINTS,
        "sink_modes": SINK_MODES,
        "backend_options": {JSONL: {"mode": "scripted", "file": str(jsonl_file), "control": str(control)}},
    }
    env = child_env()
    out_path = workdir / "trainer.out"
    with open(out_path, "w") as out, open(workdir / "trainer.err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", TRAINER, json.dumps(spec)], stdout=out, stderr=err, env=env)
        try:
            proc.wait(TRAINER_TIMEOUT)
        except subprocess.TimeoutExpired:
            pass  # checked below: trainer_completed
        finally:  # a hung trainer, or this process interrupted: the trainer must not outlive the schedule
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    stat = os.statvfs(disk)
    free_at_end = stat.f_bavail * stat.f_frsize + (ballast.stat().st_size if ballast.exists() else 0)
    # What a user would do next: free the disk, let a surviving agent finish (its trainer is gone).
    ballast.unlink(missing_ok=True)
    for pid in agent_pids(run_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    trainer = parse_trainer_output(out_path.read_text())
    killed = trainer.killed_at is not None
    stderr_tail = (workdir / "trainer.err").read_text()[-1500:]
    if not outcome.check(
        "trainer_completed",
        killed or (trainer.report is not None and len(trainer.logged) == schedule.records),
        f"exit code {proc.returncode}, {len(trainer.logged)}/{schedule.records} logged, "
        f"report {'printed' if trainer.report else 'missing'}; stderr: {stderr_tail}",
    ):
        pass
    exited = wait_for(lambda: not agent_pids(run_dir), AGENT_EXIT_TIMEOUT if killed else 30.0)
    outcome.check("agent_exited", exited, f"agents {agent_pids(run_dir)} still serve the run")
    if not exited:
        for pid in agent_pids(run_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    keep_evidence(run_dir, workdir / "evidence")
    if not (run_dir / "journal").is_dir():
        return
    report = trainer.report if trainer.report is not None else report_now(run_dir)
    by_seq, tables = journal_records(run_dir)
    journal_ids = set(by_seq.values())
    logged = set(trainer.logged)
    damaged = set(trainer.damaged.values())
    # A sink hung past finish keeps its call, and the agent is killed at the deadline: what the sink held unflushed
    # when the hang began is re-sent by the replay, as after any agent death.
    agent_died = any(f.kind in AGENT_DEATHS or (f.kind == "sink_hang" and f.until is None) for f in schedule.faults)

    # -- the agent's own account --------------------------------------------------------------------
    agent_log = (
        (workdir / "evidence" / "agent.log").read_text(errors="replace") if (workdir / "evidence" / "agent.log").exists() else ""
    )
    uncaught = [line for line in agent_log.splitlines() if line.startswith("Exception in thread")]
    outcome.check("follower_survives", not uncaught, f"{uncaught[:3]}; {_last_error(agent_log)}")
    failed_in_log = set(re.findall(r"sink '([^']+)' (?:failed|gave up)", agent_log))
    if trainer.report is not None:
        for name in SINKS:
            r = report["sinks"].get(name) or {}
            outcome.check(
                "cause_named",
                not (name in failed_in_log and r.get("state") == "pending" and "before the deadline" in (r.get("error") or "")),
                f"{name} reported '{r.get('state')}: {r.get('error')}' but the agent's log says: " + _last_error(agent_log, name),
            )

    # -- the journal against what the trainer logged ------------------------------------------------
    outcome.check(
        "journal_nothing_invented",
        journal_ids <= logged and len(journal_ids) == len(by_seq),
        f"not logged: {sorted(journal_ids - logged)[:10]}; seqs {len(by_seq)} for {len(journal_ids)} ids",
    )
    missing = logged - journal_ids - damaged
    allowed = set()
    if killed:
        horizon = _kill_horizon(schedule, trainer)
        allowed = {i for i, t in trainer.logged.items() if t >= horizon}
    unwritten = report.get("unwritten", 0)
    outcome.check(
        "journal_complete",
        len(missing - allowed) <= unwritten if not killed else not (missing - allowed),
        f"{len(missing - allowed)} logged records missing from the journal, not damaged"
        f"{'' if not killed else ', older than the kill window'}: {sorted(missing - allowed)[:10]} (unwritten {unwritten})",
    )
    if not killed:
        outcome.check(
            "unwritten_exact",
            unwritten == len(missing),
            f"report says {unwritten} unwritten; {len(missing)} logged records are not in the journal "
            f"(first {sorted(missing)[:10]})",
        )
    outcome.check(
        "report_records",
        report["records"] == len(by_seq) + unwritten,
        f"report records {report['records']} != journal {len(by_seq)} + unwritten {unwritten}",
    )

    # -- damage is counted only where the schedule made it --------------------------------------------
    cursors = {
        name: json.loads((workdir / "evidence" / f"{name}.json").read_text())
        for name in SINKS
        if (workdir / "evidence" / f"{name}.json").exists()
    }
    for where, counted in [("report", report.get("damage") or {})] + [
        (f"{n} cursor", c.get("damage") or {}) for n, c in cursors.items()
    ]:
        frames, damaged_bytes, torn = (counted.get(k, 0) for k in ("damaged_frames", "damaged_bytes", "torn_bytes"))
        outcome.check(
            "damage_only_where_damaged",
            frames <= len(trainer.damaged)
            and damaged_bytes <= DAMAGE_BYTES_PER_FRAME * len(trainer.damaged)
            and (killed or not torn),
            f"{where} counts {frames} damaged frames, {damaged_bytes} damaged bytes, {torn} torn bytes; the schedule "
            f"damaged {len(trainer.damaged)} frames{'' if killed else ' and killed no writer'}",
        )

    # -- faults that are over leave nothing behind ---------------------------------------------------
    over = not killed and all(f.until is not None for f in schedule.faults if f.kind in WINDOWS)
    if over and free_at_end >= LOW_SPACE:
        outcome.check(
            "nothing_lost_when_space_returns",
            unwritten == 0 and not missing,
            f"{unwritten} unwritten, {len(missing)} logged records not in the journal (first {sorted(missing)[:10]}) "
            f"although every full disk was freed before finish ({free_at_end // 1024} KiB free at the end); "
            f"notes {report.get('notes')}",
        )
    if over and all(recoverable(f) for f in schedule.faults):
        late = {n: r for n, r in report["sinks"].items() if r["state"] != "delivered"}
        outcome.check(
            "delivered_after_faults_end",
            not late,
            "; ".join(
                f"{n}: {r['state']} ({r['delivered']} delivered, {r['pending']} pending): {r['error']}" for n, r in late.items()
            ),
        )

    others_over = not killed and all(
        f.kind in SINK_MODES or (recoverable(f) and (f.kind in POINTS or f.until is not None)) for f in schedule.faults
    )
    if others_over and trainer.report is not None and free_at_end >= LOW_SPACE:
        late = {n: r for n, r in report["sinks"].items() if n != JSONL and r["state"] != "delivered"}
        outcome.check(
            "others_unaffected",
            not late,
            "; ".join(
                f"{n}: {r['state']} ({r['delivered']} delivered, {r['pending']} pending): {r['error']}" for n, r in late.items()
            ),
        )

    # -- each sink against the journal and its report ----------------------------------------------
    held = read_sinks(run_dir, jsonl_file, schedule.table_names)
    _check_sinks(outcome, "after finish", held, report, journal_ids, tables, logged, agent_died, killed)

    # -- replay what is pending, with the CLI --------------------------------------------------------
    control.write_text(json.dumps({"mode": "ok"}))
    needs = [n for n in SINKS if n in report["sinks"] and report["sinks"][n]["pending"] > unwritten]
    needs += [n for n in SINKS if n in report["sinks"] and report["sinks"][n]["state"] != "delivered" and n not in needs]
    for name in needs:
        result = replay(run_dir, name, env)
        outcome.check(
            "replay_completes",
            result.returncode == 0,
            f"`rllog replay --to {name}` exit {result.returncode}: {result.stdout[-800:]}",
        )
    after = report_now(run_dir)
    held = read_sinks(run_dir, jsonl_file, schedule.table_names)
    for name in SINKS:
        r = after["sinks"].get(name)
        if r is None:
            outcome.check("replay_completes", False, f"{name}: no cursor after replay")
            continue
        dead = {by_seq.get(d["seq"]) for d in r["dead_letter_list"]}
        lacking = journal_ids - dead - held[name].ids
        if name == "tensorboard":
            lacking -= tables  # TensorBoard stores tables as text, not under the id scalar
        outcome.check(
            "replay_completes",
            not lacking
            and (
                (r["state"] == "delivered" and r["pending"] == after["unwritten"])
                or (r["dead_letters"] and r["state"] != "pending")
            ),
            f"{name} after replay: {r['state']} {r['delivered']} delivered {r['pending']} pending "
            f"{r['dead_letters']} dead; lacks {len(lacking)} journal records {sorted(lacking)[:10]}; error {r['error']}",
        )
    _check_sinks(outcome, "after replay", held, after, journal_ids, tables, logged, agent_died, killed)
    before = {name: held[name].counts.copy() for name in SINKS}
    for name in SINKS:
        replay(run_dir, name, env)
    held = read_sinks(run_dir, jsonl_file, schedule.table_names)
    for name in SINKS:
        grown = held[name].counts - before[name]
        outcome.check("replay_no_resend", not grown, f"a second replay re-sent {sorted(grown)[:10]} to {name}")


def recoverable(f: Fault) -> bool:
    """Whether every sink must be delivered by finish once ``f`` is over: a 429 that asked for a short wait is; one
    without ``Retry-After`` backs off like ``sink_down``, possibly past finish's deadline."""
    if f.kind == "sink_rate_limited":
        return f.arg is not None and float(f.arg) <= SHORT_RETRY_AFTER
    return f.kind in RECOVERABLE


def _last_error(agent_log: str, sink: str | None = None) -> str:
    lines = [line for line in agent_log.splitlines() if " ERROR " in line and (sink is None or f"'{sink}'" in line)]
    return lines[-1][:400] if lines else "(no error logged)"


def _kill_horizon(schedule: Schedule, trainer: TrainerLog) -> float:
    """The monotonic time after which a record logged may be missing from the journal of a SIGKILLed trainer: the
    kill less ``flush_interval``, or earlier where the disk was full until less than ``flush_interval`` before the
    kill (a record logged then waited in memory for the space; the writer retries every write interval)."""
    assert trainer.killed_at is not None
    window = schedule.flush_interval
    horizon = trainer.killed_at - window
    kill_index = max(trainer.logged, default=0) + 1
    for f in schedule.faults:
        if f.kind != "disk_full" or f.at > kill_index:
            continue
        began = trainer.logged.get(f.at - 1, 0.0)
        freed = trainer.logged.get(f.until - 1, trainer.killed_at) if f.until is not None else trainer.killed_at
        if freed >= trainer.killed_at - window:
            horizon = min(horizon, began - window)
    return horizon


def _check_sinks(
    outcome: Outcome,
    when: str,
    held: dict[str, Held],
    report: dict,
    journal_ids: set[int],
    tables: set[int],
    logged: set[int],
    agent_died: bool,
    killed: bool,
) -> None:
    unwritten = report.get("unwritten", 0)
    for name in SINKS:
        r = report["sinks"].get(name)
        h = held[name]
        outcome.check(
            "sink_nothing_invented",
            h.ids <= logged,
            f"{when}: {name} holds records never logged: {sorted(h.ids - logged)[:10]}",
        )
        if name == "parquet" or (name == JSONL and not agent_died):
            outcome.check(
                "sink_no_duplicate",
                not h.doubled() and not h.unreadable,
                f"{when}: {name} holds {len(h.doubled())} records twice: {h.doubled()[:10]}"
                + (f"; {h.unreadable} unreadable lines" if h.unreadable else ""),
            )
        if r is None:
            outcome.check("report_arithmetic", False, f"{when}: no report for {name}")
            continue
        outcome.check(
            "report_arithmetic",
            r["delivered"] + r["pending"] + r["dead_letters"] == report["records"],
            f"{when}: {name}: {r['delivered']} + {r['pending']} + {r['dead_letters']} != {report['records']}",
        )
        comparable = journal_ids - (tables if name == "tensorboard" else set())
        present = comparable & h.ids
        held_count = len(present) + (len(journal_ids & tables) if name == "tensorboard" else 0)
        outcome.check(
            "report_delivered_held",
            held_count >= r["delivered"],
            f"{when}: {name} report says {r['delivered']} delivered; it holds {held_count} journal records",
        )
        lacking = comparable - h.ids
        outcome.check(
            "missing_is_reported",
            len(lacking) <= max(0, r["pending"] - unwritten) + r["dead_letters"],
            f"{when}: {name} lacks {len(lacking)} journal records {sorted(lacking)[:10]}; report: {r['state']}, "
            f"{r['pending']} pending ({unwritten} unwritten), {r['dead_letters']} dead; error {r['error']}",
        )
        if r["state"] == "delivered" and name != "tensorboard":
            outcome.check(
                "missing_is_reported",
                len(lacking) <= r["dead_letters"],
                f"{when}: {name} is 'delivered' but lacks {sorted(lacking)[:10]}",
            )
        dead_listed = [d.get("seq") for d in r["dead_letter_list"]]
        outcome.check(
            "dead_letters_listed",
            len(dead_listed) == r["dead_letters"] or r["dead_letters"] > len(dead_listed) >= 1000,
            f"{when}: {name}: {r['dead_letters']} dead letters, {len(dead_listed)} listed",
        )
        outcome.check(
            "failed_only_for_good",
            r["state"] != "failed" or (name == JSONL and CRASH_MESSAGE in (r["error"] or "")),
            f"{when}: {name} is failed: {r['error']}",
        )
        resource_dead = [d for d in r["dead_letter_list"] if is_resource_error(d.get("error"))]
        outcome.check(
            "resource_error_transient",
            not resource_dead and not (r["state"] == "failed" and is_resource_error(r["error"])),
            f"{when}: {name} is {r['state']} ({r['error']}); {len(resource_dead)} records dead-lettered "
            f"for a resource error, first {resource_dead[:2]}",
        )


def replay(run_dir: Path, name: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rllog.cli", "replay", str(run_dir), "--to", name],
        capture_output=True,
        text=True,
        env=env | {"COLUMNS": "200"},
        timeout=REPLAY_TIMEOUT,
    )


def shrink(
    schedule: Schedule, invariant: str, workdir: Path, max_runs: int = 12, log: Callable[[str], None] = lambda s: None
) -> Schedule:
    """The smallest schedule found that still violates ``invariant``: faults deleted one at a time, then the run
    halved, while the violation persists (``max_runs`` runs at most; faults are real and timing varies, so a
    step is kept only when the violation reproduced)."""
    current, runs = schedule, 0

    def still_fails(candidate: Schedule) -> bool:
        nonlocal runs
        runs += 1
        outcome = run_schedule(candidate, workdir / f"shrink-{runs}")
        log(f"  shrink try {runs}: {candidate.describe()} -> {'fails' if invariant in outcome.keys else 'passes'}")
        return invariant in outcome.keys

    progress = True
    while progress and runs < max_runs:
        progress = False
        for i in range(len(current.faults)):
            if runs >= max_runs:
                break
            candidate = replace(current, faults=current.faults[:i] + current.faults[i + 1 :])
            if still_fails(candidate):
                current, progress = candidate, True
                break
        if not progress and current.records > 200 and runs < max_runs:
            candidate = current.scaled(0.5)
            if still_fails(candidate):
                current, progress = candidate, True
    return current
