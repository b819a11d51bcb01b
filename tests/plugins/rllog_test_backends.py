"""Test-only backends, registered through a real entry point (tests/plugins/*.dist-info) so the delivery
agent process builds them by name like any third-party backend.

``JsonlSink`` writes every record it accepts to ``RUN_DIR/<file>`` (one JSON line each), so tests can
count deliveries exactly. Its ``mode`` (option, or ``$RLLOG_TEST_MODE_<NAME>`` which wins, so a replay
can find it healthy) injects faults: ``ok``, ``hang`` (blocks forever), ``crash`` (raises on every write),
``down`` (``TransientError`` on every write: a tracker that is down).

``scripted`` takes its mode from a control file (option ``control``, default ``RUN_DIR/<name>.control``:
``{"mode": ...}``) read again at every call, so a fault schedule (tests/fault_schedules.py) can switch faults
while the agent runs: the modes above plus ``memory`` (``MemoryError``) and ``emfile`` (``OSError(EMFILE)``),
the resource errors a tracker's process can raise, and ``rate_limited`` (``RateLimited`` with the control's
``retry_after``: an HTTP 429). In this mode ``hang`` blocks every call, ``flush`` and ``close`` included, only
while the control file says so. A missing or half-written control file reads as ``ok``.
In this mode each call's lines go to the file in one unbuffered write, so an agent SIGKILLed at any instant
leaves whole lines (a buffered file could leave half a line for the re-sent record to be appended to).
"""

import errno
import importlib
import json
import os
import threading
import time

from rllog.errors import RateLimited, TransientError
from rllog.sink import Capabilities


class JsonlSink:
    capabilities = Capabilities(tables=True, config=False)

    def __init__(self, name="jsonl", mode="ok", file=None, control=None, imports=None):
        self.name = name
        self.imports = imports  # a module imported at open, as a tracker's library is
        self.mode = os.environ.get(f"RLLOG_TEST_MODE_{name.upper()}", mode)
        self.file = file or f"{name}.jsonl"
        self.control = control

    def open(self, run_info):
        if self.imports:
            importlib.import_module(self.imports)
        path = os.path.join(run_info.run_dir, self.file)
        if self.mode == "scripted":
            self.control = self.control or os.path.join(run_info.run_dir, f"{self.name}.control")
            self.f = open(path, "ab", buffering=0)
        else:
            self.f = open(path, "a")

    def _control(self):
        if self.mode != "scripted":
            return {"mode": self.mode}
        try:
            with open(self.control) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {"mode": "ok"}

    def _current_mode(self):
        return self._control().get("mode", "ok")

    def _hang(self):
        if self.mode != "scripted":
            threading.Event().wait()
        while self._current_mode() == "hang":  # a scripted hang lasts as long as its window
            time.sleep(0.05)

    def _check(self):
        control = self._control()
        mode = control.get("mode", "ok")
        if mode == "hang":
            self._hang()
        if mode == "rate_limited":
            raise RateLimited(control.get("retry_after"), f"{self.name}: HTTP 429")
        if mode == "crash":
            raise RuntimeError(f"{self.name} crashed on purpose")
        if mode == "down":
            raise TransientError(f"{self.name} is down")
        if mode == "memory":
            raise MemoryError(f"{self.name} ran out of memory on purpose")
        if mode == "emfile":
            raise OSError(errno.EMFILE, "Too many open files (on purpose)")

    def _write_lines(self, items):
        text = "".join(json.dumps(item) + "\n" for item in items)
        self.f.write(text.encode() if self.mode == "scripted" else text)

    def write_metrics(self, records):
        self._check()
        self._write_lines({"seq": r.seq, "step": r.step, "values": dict(r.values)} for r in records)

    def write_table(self, record):
        self._check()
        ids = record.table.column("id").to_pylist() if "id" in record.table.column_names else None
        item = {"seq": record.seq, "step": record.step, "table": record.name, "rows": record.table.num_rows}
        self._write_lines([item | ({"ids": ids} if ids is not None else {})])

    def flush(self):
        if self._current_mode() in ("memory", "emfile"):  # a resource error can come from any call
            self._check()
        if self.mode == "scripted" and self._current_mode() == "hang":  # so can a hang
            self._hang()
        self.f.flush()

    def close(self, status):
        if self.mode == "scripted" and self._current_mode() == "hang":
            self._hang()
        self._write_lines([{"status": status}])
        self.f.close()


def read_jsonl(path):
    """The lines a JsonlSink wrote: (records, statuses)."""
    records, statuses = [], []
    if os.path.exists(path):
        for line in open(path):
            item = json.loads(line)
            (statuses if "status" in item else records).append(item.get("status", item))
    return records, statuses


class HangsSink(JsonlSink):
    def __init__(self, mode="hang", file=None):
        super().__init__("hangs", mode, file)


class CrashesSink(JsonlSink):
    def __init__(self, mode="crash", file=None):
        super().__init__("crashes", mode, file)


class DownSink(JsonlSink):
    def __init__(self, mode="down", file=None):
        super().__init__("down", mode, file)
