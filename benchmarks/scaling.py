"""Scaling: metrics per step, completions table size, ranks, and a sink that is down for the whole run.

- 10 / 100 / 1000 metrics per ``log`` call: rllog (6 sinks; quick: parquet only) against the five trackers' own APIs.
- completions tables of 64 / 1,000 / 10,000 rows: rllog's Parquet writer against raw pyarrow
  (``pa.table`` + ``pq.write_table``) on the same rows, interleaved in one process (target >= 0.8x raw
  throughput); and the whole rllog path (``log_table`` -> journal -> agent -> Parquet -> ``finish``).
- 1 / 2 / 4 ranks (torchrun, gloo): the cost of one ``log`` call, which reduces across ranks, against
  one bare ``all_reduce`` of the same 30 values.
- a sink that is down for the whole run (the test-only ``down`` backend: every write raises
  ``TransientError``): the hot path, and ``finish`` returning at its deadline with the other sink complete.

    .venv/bin/python benchmarks/scaling.py [--quick]
"""

from __future__ import annotations

import math
import random
import sys
import time
from pathlib import Path

import harness
import hot_path
from harness import FIVE, SIX, fmt_ratio, md_table, progress, ratio, run_case, summarize_ns, verdict

SCRIPT = Path(__file__).resolve()
TABLE_TARGET = 0.8


# --- completions tables ---------------------------------------------------------------------------------


def completions(rows: int, step: int) -> dict[str, list]:
    """A completions table as TRL's GRPO has it: prompt, completion, a column per reward function, advantage."""
    rng = random.Random(step)
    words = "the answer is twelve because seven plus five equals twelve and so on".split()
    prompts = [
        f"<|im_start|>user\nWhat is {rng.randint(1, 99)} plus {rng.randint(1, 99)}?<|im_end|>\n<|im_start|>assistant\n"
        for _ in range(rows)
    ]
    texts = [" ".join(rng.choices(words, k=rng.randint(8, 40))) for _ in range(rows)]
    return {
        "prompt": prompts,
        "completion": texts,
        "reward_accuracy": [rng.random() for _ in range(rows)],
        "reward_format": [float(rng.random() < 0.5) for _ in range(rows)],
        "n_chars": [len(t) for t in texts],
        "advantage": [rng.gauss(0, 1) for _ in range(rows)],
    }


def case_tables_compare(params: dict, workdir: Path) -> dict:
    """Raw pyarrow against rllog's Parquet writer on the same tables, interleaved in this one process (so both
    sides see the same machine noise).

    Raw: the dict of columns -> ``pa.table`` -> ``pq.write_table``, a file per table. rllog: the same dict ->
    ``to_arrow_table`` (what ``log_table`` does on the caller's thread) -> ``ParquetSink.write_table`` +
    ``flush`` (a part file per table, as in delivery); ``close`` (compaction of the parts into one file) is
    timed apart and spread over the tables.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rllog.records import RunInfo, TableRecord
    from rllog.validate import to_arrow_table
    from rllog_backends.parquet import ParquetSink

    count = params["count"]
    tables = [completions(params["rows"], step) for step in range(count + 1)]
    raw_dir = workdir / "raw"
    raw_dir.mkdir()
    sink = ParquetSink()
    sink.open(RunInfo("bench", "tables", str(workdir), "0" * 16, {}, ()))

    def raw(i):
        pq.write_table(pa.table(tables[i]), raw_dir / f"completions_{i:05d}.parquet")

    def mine(i):
        sink.write_table(TableRecord(i + 1, i, time.time(), "completions", to_arrow_table("completions", tables[i])))
        sink.flush()

    raw(count)  # warm-up (first-call costs and imports), untimed; the sink's warm-up table is part of its file
    mine(count)
    import pyarrow.dataset

    pq.read_table(raw_dir / f"completions_{count:05d}.parquet")
    raw_ns, sink_ns = [], []
    clock = time.perf_counter_ns
    for i in range(count):
        for side in ((raw, raw_ns), (mine, sink_ns)) if i % 2 == 0 else ((mine, sink_ns), (raw, raw_ns)):
            t = clock()
            side[0](i)
            side[1].append(clock() - t)
    t = time.perf_counter()
    sink.close("finished")
    close_s = time.perf_counter() - t
    raw_s = summarize_ns(raw_ns)["median_us"] / 1e6
    sink_s = summarize_ns(sink_ns)["median_us"] / 1e6 + close_s / (count + 1)
    return {
        "raw": summarize_ns(raw_ns),
        "sink": summarize_ns(sink_ns),
        "close_s": close_s,
        "raw_per_table_s": raw_s,
        "sink_per_table_s": sink_s,
        "ratio": raw_s / sink_s,
    }


def case_tables_rllog(params: dict, workdir: Path) -> dict:
    """The whole path: ``run.log_table`` (timed per call), journal, agent, Parquet, until ``finish`` returns."""
    import rllog

    tables = [completions(params["rows"], step) for step in range(params["count"])]
    run = rllog.init(report_to="parquet", project="bench-tables", run_dir=workdir / "run", health=False)
    run.log({"warmup": 1.0}, step=0)
    harness.wait_delivered(run.run_dir, ["parquet"], 1, timeout=120, settle=harness.SETTLE_S)
    samples = []
    t0 = time.perf_counter()
    for step, columns in enumerate(tables):
        t = time.perf_counter_ns()
        run.log_table("completions", columns, step=step)
        samples.append(time.perf_counter_ns() - t)
    t_last = time.perf_counter()
    report = run.finish(timeout=600)
    end = time.perf_counter()
    rows = rllog.read_table(run.run_dir, "completions").num_rows
    return {
        "total_s": end - t0,
        "drain_s": end - t_last,
        "per_call": summarize_ns(samples),
        "delivered": report.ok,
        "rows_read_back": rows,
    }


# --- ranks ---------------------------------------------------------------------------------------------


def case_ranks(params: dict, workdir: Path) -> dict | None:
    """Under torchrun: every rank logs the same 30 keys; rank 0 times ``run.log`` and a bare all_reduce."""
    import torch
    import torch.distributed as dist

    import rllog

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    calls = params["calls"]
    run = rllog.init(report_to="none", project="bench-ranks", run_dir=workdir / "run", health=False)

    def batch(step):
        return harness.grpo_metrics(step, 30, seed=rank)

    for step in range(20):
        run.log(batch(step), step=step)
    batches = [batch(step) for step in range(20, 20 + calls)]
    log_ns, bare_ns = [], []
    clock = time.perf_counter_ns
    for i, values in enumerate(batches):
        dist.barrier()  # all ranks start the call together: the time is the reduction's, not a slow rank's
        t = clock()
        run.log(values, step=20 + i)
        log_ns.append(clock() - t)
        tensor = torch.tensor(list(values.values()), dtype=torch.float64)
        dist.barrier()
        t = clock()
        dist.all_reduce(tensor)
        tensor.tolist()
        bare_ns.append(clock() - t)
    run.finish(timeout=120)
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return None
    return {"world_size": world, "log": summarize_ns(log_ns), "bare_all_reduce": summarize_ns(bare_ns)}


CASES = {"tables_compare": case_tables_compare, "tables_rllog": case_tables_rllog, "ranks": case_ranks}
CASES.update({"rllog": hot_path.case_rllog, "direct": hot_path.case_direct})


# --- the runs ------------------------------------------------------------------------------------------


def run(quick: bool, tmp: Path) -> dict:
    results: dict = {}
    # metrics per step
    sizes = [10, 100, 1000]
    results["metrics"] = []
    configs = [("rllog, 6 sinks", "rllog", {"sinks": SIX}), ("five trackers, own APIs", "direct", {"trackers": FIVE})]
    if quick:  # the caller's cost does not depend on the sinks; the six take ~15 s to open in each process
        configs = [("rllog, 1 sink (parquet)", "rllog", {"sinks": ["parquet"]})]
    results["metrics_sinks"] = configs[0][0]
    for n in sizes:
        calls = (60 if quick else 100) if n >= 1000 else (200 if quick else 300)
        for label, case, params in configs:
            progress(f"scaling: {n} metrics per step, {label}")
            # Only the calls are measured here: finish waits at most 30 s (the six trackers need minutes for 1,000-metric
            # steps; what was not delivered then stays in the journal). A 600 ms tracker call needs no 100 samples.
            extra = {
                "n_metrics": n,
                "calls": calls,
                "max_seconds": 5.0 if quick else 10.0,
                "warmup": 20,
                "finish_timeout": 30.0,
                "min_calls": 30 if n >= 1000 else 100,
            }
            r = run_case(SCRIPT, case, params | extra, tmp)
            results["metrics"].append({"n_metrics": n, "label": label, **r})
    # tables
    results["tables"] = []
    for rows in [64, 1000, 10000]:
        # many tables: a flush per table (each appended to the store's tail), the tails turned into parts at close
        count = {64: 40, 1000: 20, 10000: 20}[rows] if not quick else {64: 20, 1000: 20, 10000: 8}[rows]
        for kind in ["tables_compare", "tables_rllog"]:
            progress(f"scaling: tables of {rows} rows x {count}, {kind}")
            r = run_case(SCRIPT, kind, {"rows": rows, "count": count}, tmp)
            results["tables"].append({"rows": rows, "count": count, "kind": kind, **r})
    # ranks
    results["ranks"] = []
    for world in [1, 2] if quick else [1, 2, 4]:
        progress(f"scaling: {world} rank(s), torchrun gloo")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world), str(SCRIPT)]
        r = run_case(SCRIPT, "ranks", {"calls": 200 if quick else 500}, tmp, command=command)
        results["ranks"].append({"world": world, **r})
    # a sink down for the whole run
    results["down"] = []
    calls = 300 if quick else 1000
    for label, sinks in [("parquet", ["parquet"]), ("parquet + down", ["parquet", "down"])]:
        progress(f"scaling: {label}")
        r = run_case(
            SCRIPT, "rllog", {"sinks": sinks, "wait_for": ["parquet"], "calls": calls, "finish_timeout": 10.0}, tmp, plugins=True
        )
        results["down"].append({"label": label, **r})
    return results


def _metric_rows(results: dict) -> list[list]:
    rows = []
    for n in sorted({r["n_metrics"] for r in results["metrics"]}):
        mine = next(
            (r for r in results["metrics"] if r["n_metrics"] == n and r["label"].startswith("rllog") and "error" not in r), None
        )
        theirs = next(
            (r for r in results["metrics"] if r["n_metrics"] == n and r["label"].startswith("five") and "error" not in r), None
        )
        rows.append(
            [
                f"{n:,}",
                mine and mine["median_us"],
                mine and mine["p99_us"],
                mine and mine["median_us"] / n,
                theirs and theirs["median_us"],
                theirs and theirs["p99_us"],
                fmt_ratio(ratio(theirs and theirs["median_us"], mine and mine["median_us"])),
            ]
        )
    return rows


def table_ratios(results: dict) -> list[dict]:
    out = []
    for rows in sorted({r["rows"] for r in results["tables"]}):
        get = {r["kind"]: r for r in results["tables"] if r["rows"] == rows and "error" not in r}
        cmp, full = get.get("tables_compare"), get.get("tables_rllog")
        count = (cmp or full or {}).get("count", 0)
        raw_s = cmp and cmp["raw_per_table_s"]
        out.append(
            {
                "rows": rows,
                "count": count,
                "raw_ms": raw_s and raw_s * 1e3,
                "sink_ms": cmp and cmp["sink_per_table_s"] * 1e3,
                "close_ms": cmp and cmp["close_s"] * 1e3,
                "sink_vs_raw": cmp["ratio"] if cmp else math.nan,
                "full_ms": full and full["total_s"] * 1e3 / count,
                "full_vs_raw": ratio(raw_s, full and full["total_s"] / count),
                "log_table_us": full and full["per_call"]["median_us"],
                "read_back": full and full.get("rows_read_back"),
            }
        )
    return out


def targets(results: dict) -> list[dict]:
    out = []
    for t in table_ratios(results):
        r = t["sink_vs_raw"]
        out.append(
            {
                "what": f"table of {t['rows']:,} rows: Parquet writer throughput / raw pyarrow",
                "target": f">= {TABLE_TARGET}x",
                "measured": fmt_ratio(r),
                "met": r >= TABLE_TARGET if r == r else False,
            }
        )
    return out


def render(results: dict) -> str:
    out = [
        f"**Metrics per step** (median/p99 us per call; {results.get('metrics_sinks', 'rllog')}; the five trackers' own APIs one after the other):",
        "",
        md_table(
            [
                "metrics per call",
                "rllog median",
                "rllog p99",
                "rllog us per metric",
                "five own APIs median",
                "five own APIs p99",
                "own APIs / rllog",
            ],
            _metric_rows(results),
        ),
    ]
    rows = []
    for t in table_ratios(results):
        rows.append(
            [
                f"{t['rows']:,} x {t['count']}",
                t["raw_ms"],
                t["sink_ms"],
                t["close_ms"],
                fmt_ratio(t["sink_vs_raw"]),
                t["full_ms"],
                fmt_ratio(t["full_vs_raw"]),
                t["log_table_us"],
                t["read_back"],
            ]
        )
    out += [
        "",
        "**Completions tables** (ms per table; raw and rllog's writer interleaved in one process, medians; the whole rllog path "
        "in its own process; throughput ratio = raw time / rllog time, higher is better):",
        "",
        md_table(
            [
                "rows x tables",
                "raw pyarrow",
                "rllog ParquetSink (incl. its share of close)",
                "close (compaction), all tables",
                "ParquetSink / raw",
                "whole rllog path (log_table -> finish), per table",
                "whole path / raw",
                "log_table call median us",
                "rows read back",
            ],
            rows,
        ),
    ]
    rows = []
    for r in results["ranks"]:
        if "error" in r:
            rows.append([r["world"], "failed", "", "", "", ""])
            continue
        rows.append(
            [
                r["world"],
                r["log"]["median_us"],
                r["log"]["p99_us"],
                r["bare_all_reduce"]["median_us"],
                r["bare_all_reduce"]["p99_us"],
                fmt_ratio(ratio(r["log"]["median_us"], r["bare_all_reduce"]["median_us"])) if r["world"] > 1 else "no reduction",
            ]
        )
    out += [
        "",
        "**Ranks** (torchrun, gloo, on this 2-core machine: 4 ranks oversubscribe it; us per call on rank 0, ranks aligned by a barrier before each call):",
        "",
        md_table(
            ["ranks", "rllog log() median", "rllog log() p99", "one bare all_reduce median", "bare all_reduce p99", "log / bare"],
            rows,
        ),
    ]
    rows = []
    for r in results["down"]:
        if "error" in r:
            rows.append([r["label"], "failed", "", "", "", ""])
            continue
        states = "; ".join(
            f"{k}: {v['state']} ({v['delivered']:,} delivered, {v['pending']:,} pending)" for k, v in r.get("sinks", {}).items()
        )
        rows.append([r["label"], r["median_us"], r["p99_us"], r["n"], r["finish_s"], states])
    out += [
        "",
        "**A sink down for the whole run** (`down`: every write raises `TransientError`; `finish(timeout=10)`):",
        "",
        md_table(["report_to", "log median us", "log p99 us", "calls", "finish s", "delivery at finish"], rows),
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
