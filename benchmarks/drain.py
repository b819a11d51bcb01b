"""Drain: from the last ``log`` call to ``finish()`` returning with everything delivered, against the
tracker's own time to take the same data directly. Target: <= 1.2x.

A burst of ``steps`` steps of 30 metrics is logged back to back, so (nearly) all delivery happens after
the last call: the worst case for the drain. rllog: trackers are open before the burst (the agent has
delivered and flushed a first record); the clock runs from the return of the last ``log`` to the return of
``finish()`` (journal written, every sink written, flushed and closed, agent exited). Direct: trackers
are open before the burst too; the clock runs from the first of the same ``log`` calls to the return of
the tracker's own finish (``wandb.finish``, ``mlflow.end_run``, ``writer.close``, ``experiment.end``,
``trackio.finish``; for Parquet, pyarrow building the same long-format table and ``pq.write_table``).

    .venv/bin/python benchmarks/drain.py [--quick]
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import harness
from harness import SIX, fmt_ratio, grpo_metrics, md_table, progress, ratio, run_case, verdict
from hot_path import make_direct

SCRIPT = Path(__file__).resolve()
TARGET = 1.2


class RawParquet:
    """What "writing the same data to Parquet yourself" costs: rows kept in lists, one table, one file."""

    name = "parquet"

    def __init__(self, path: Path):
        self.path = path
        self.rows: list[tuple] = []

    def open(self, project: str) -> None:
        pass

    def log(self, metrics: dict, step: int) -> None:
        now = time.time()
        for key, value in metrics.items():
            self.rows.append((step, key, value, now))

    def close(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        step, key, value, t = zip(*self.rows, strict=False)
        table = pa.table(
            {
                "step": pa.array(step, pa.int64()),
                "key": pa.array(key),
                "value": pa.array(value, pa.float64()),
                "time": pa.array(t, pa.float64()),
            }
        )
        pq.write_table(table, self.path)


def case_rllog(params: dict, workdir: Path) -> dict:
    import rllog

    sinks, steps, n = params["sinks"], params["steps"], params.get("n_metrics", 30)
    run = rllog.init(
        report_to=sinks,
        project="bench-drain",
        name="rllog",
        config={"lr": 1e-3},
        run_dir=workdir / "run",
        delivery=params.get("delivery", "process"),
        health=params.get("health", True),
    )
    run.log(grpo_metrics(0, n), step=0)
    opened = harness.wait_delivered(run.run_dir, sinks, 1, timeout=180, settle=harness.SETTLE_S)
    batches = [grpo_metrics(step, n) for step in range(1, steps + 1)]
    t0 = time.perf_counter()
    for step, batch in enumerate(batches, start=1):
        run.log(batch, step=step)
    t_last = time.perf_counter()
    marks: dict = {}
    watch = threading.Thread(target=_watch_cursors, args=(run.run_dir, sinks, run._seq, marks), daemon=True)
    watch.start()
    report = run.finish(timeout=900)
    t_end = time.perf_counter()
    marks["stop"] = True
    watch.join()
    return {
        "log_s": t_last - t0,
        "drain_s": t_end - t_last,
        "delivered": report.ok,
        "report": str(report),
        "agent_ready_s": opened,
        "all_written_s": marks.get("written", t_end) - t_last,
        "all_closed_s": marks.get("closed", t_end) - t_last,
    }


def _watch_cursors(run_dir: Path, sinks: list[str], last_seq: int, marks: dict) -> None:
    """When every sink had accepted the last record, and when every sink was closed (from the cursor files)."""
    import json

    while not marks.get("stop"):
        states = []
        for name in sinks:
            try:
                states.append(json.loads((Path(run_dir) / "delivery" / f"{name}.json").read_text()))
            except (OSError, ValueError):
                states.append({})
        now = time.perf_counter()
        if "written" not in marks and all(s.get("seq", 0) >= last_seq for s in states):
            marks["written"] = now
        if all(s.get("state") == "closed" for s in states):
            marks.setdefault("written", now)
            marks["closed"] = now
            return
        time.sleep(0.005)


def case_direct(params: dict, workdir: Path) -> dict:
    names, steps, n = params["sinks"], params["steps"], params.get("n_metrics", 30)
    trackers = [RawParquet(workdir / "metrics.parquet") if name == "parquet" else make_direct(name) for name in names]
    for tracker in trackers:
        tracker.open("bench-drain")
    for tracker in trackers:
        tracker.log(grpo_metrics(0, n), 0)
    batches = [grpo_metrics(step, n) for step in range(1, steps + 1)]
    per_tracker = {}
    t0 = time.perf_counter()
    for tracker in trackers:  # one tracker after the other: each one's own time is measured alone
        t = time.perf_counter()
        for step, batch in enumerate(batches, start=1):
            tracker.log(batch, step)
        t_logged = time.perf_counter()
        tracker.close()
        per_tracker[tracker.name] = {"log_s": t_logged - t, "close_s": time.perf_counter() - t_logged}
    total = time.perf_counter() - t0
    return {"total_s": total, "parts": per_tracker}


CASES = {"rllog": case_rllog, "direct": case_direct}


def configurations(quick: bool) -> list[tuple[str, list[str], dict]]:
    """(label, sinks, extra rllog.init options); the last one repeats parquet without the health rules, which
    run on the journal writer thread before the end marker is written."""
    if quick:
        return [("all six", SIX, {})]
    return [(name, [name], {}) for name in SIX] + [
        ("all six", SIX, {}),
        ("parquet, health rules off", ["parquet"], {"health": False}),
    ]


def run(quick: bool, tmp: Path) -> dict:
    steps = 100 if quick else 500
    rows = []
    direct: dict[str, dict] = {}
    for label, sinks, options in configurations(quick):
        progress(f"drain: {label} (rllog)")
        mine = run_case(SCRIPT, "rllog", {"sinks": sinks, "steps": steps} | options, tmp)
        key = ",".join(sinks)
        if key not in direct:
            progress(f"drain: {label} (direct)")
            direct[key] = run_case(SCRIPT, "direct", {"sinks": sinks, "steps": steps}, tmp)
        rows.append({"label": label, "sinks": sinks, "options": options, "rllog": mine, "direct": direct[key]})
    return {"steps": steps, "rows": rows}


def targets(results: dict) -> list[dict]:
    out = []
    for row in results["rows"]:
        if row.get("options"):  # a diagnostic row, not a default configuration
            continue
        r = ratio(row["rllog"].get("drain_s"), row["direct"].get("total_s"))
        out.append(
            {
                "what": f"drain, {row['label']}: rllog drain / direct",
                "target": f"<= {TARGET}x",
                "measured": fmt_ratio(r),
                "met": r <= TARGET if r == r else False,
            }
        )
    return out


def render(results: dict) -> str:
    table = []
    for row in results["rows"]:
        mine, theirs = row["rllog"], row["direct"]
        if "error" in mine or "error" in theirs:
            table.append(
                [row["label"], "failed" if "error" in mine else "", "", "", "", "failed" if "error" in theirs else "", "", ""]
            )
            continue
        r = ratio(mine["drain_s"], theirs["total_s"])
        table.append(
            [
                row["label"],
                mine["log_s"] * 1e3,
                mine["drain_s"],
                mine.get("all_written_s"),
                mine.get("all_closed_s"),
                theirs["total_s"],
                fmt_ratio(r),
                "yes" if mine.get("delivered") else "**no**",
            ]
        )
    direct_all = next((row["direct"] for row in results["rows"] if row["label"] == "all six" and "parts" in row["direct"]), None)
    parts = []
    if direct_all:
        for name, p in direct_all["parts"].items():
            parts.append([name, p["log_s"], p["close_s"], p["log_s"] + p["close_s"]])
    out = [
        f"{results['steps']} steps of 30 metrics logged back to back; every configuration in its own process.",
        "",
        md_table(
            [
                "sinks",
                "rllog: the burst's log calls, ms",
                "rllog: last log -> finish() returned, s",
                "of which: every record written to every sink, s",
                "every sink closed, s",
                "direct: log calls + own finish, s",
                "drain ratio",
                "everything delivered",
            ],
            table,
        ),
    ]
    if parts:
        out += [
            "",
            "Direct, all six, per tracker (s): the trackers' own time for the same data.",
            "",
            md_table(["tracker", "log calls", "own finish/close", "total"], parts),
        ]
    out += [
        "",
        md_table(
            ["target", "wanted", "measured", "result"],
            [[t["what"], t["target"], t["measured"], verdict(t["met"])] for t in targets(results)],
        ),
    ]
    return "\n".join(out)


if __name__ == "__main__":
    harness.module_main(run, render, CASES, __doc__)
