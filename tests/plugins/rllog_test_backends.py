"""Test-only backends, registered through a real entry point (tests/plugins/*.dist-info) so the delivery
agent process builds them by name like any third-party backend.

``JsonlSink`` writes every record it accepts to ``RUN_DIR/<file>`` (one JSON line each), so tests can
count deliveries exactly. Its ``mode`` (option, or ``$RLLOG_TEST_MODE_<NAME>`` which wins, so a replay
can find it healthy) injects faults: ``ok``, ``hang`` (blocks forever), ``crash`` (raises on every write),
``down`` (``TransientError`` on every write: a tracker that is down).
"""

import json
import os
import threading

from rllog.errors import TransientError
from rllog.sink import Capabilities


class JsonlSink:
    capabilities = Capabilities(tables=True, config=False)

    def __init__(self, name="jsonl", mode="ok", file=None):
        self.name = name
        self.mode = os.environ.get(f"RLLOG_TEST_MODE_{name.upper()}", mode)
        self.file = file or f"{name}.jsonl"

    def open(self, run_info):
        self.f = open(os.path.join(run_info.run_dir, self.file), "a")

    def _check(self):
        if self.mode == "hang":
            threading.Event().wait()
        if self.mode == "crash":
            raise RuntimeError(f"{self.name} crashed on purpose")
        if self.mode == "down":
            raise TransientError(f"{self.name} is down")

    def write_metrics(self, records):
        self._check()
        for r in records:
            self.f.write(json.dumps({"seq": r.seq, "step": r.step, "values": dict(r.values)}) + "\n")

    def write_table(self, record):
        self._check()
        self.f.write(
            json.dumps({"seq": record.seq, "step": record.step, "table": record.name, "rows": record.table.num_rows}) + "\n"
        )

    def flush(self):
        self.f.flush()

    def close(self, status):
        self.f.write(json.dumps({"status": status}) + "\n")
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
