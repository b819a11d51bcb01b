"""rllog's overhead benchmarks, side by side with direct tracker calls, accelerate and transformers.

    .venv/bin/python benchmarks/run.py            # everything (about 15-20 minutes on 2 cores)
    .venv/bin/python benchmarks/run.py --quick    # fewer calls, steps and configurations (under 5 minutes)

Runs hot_path, drain, scaling, end_to_end and syncs (each also runnable alone: ``python benchmarks/<name>.py``),
then cProfile for every missed target, and writes ``docs/benchmarks.md`` and ``docs/benchmarks.png``.
Every measured configuration runs in its own process, one at a time. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import drain
import end_to_end
import gpu
import harness
import hot_path
import interference
import long_run
import profiles
import scaling
import syncs
from harness import fmt, fmt_ratio, git_commit, md_table, median, progress, ratio, verdict

DOCS = harness.ROOT / "docs"
SECTIONS = {
    "hot_path": hot_path,
    "drain": drain,
    "scaling": scaling,
    "end_to_end": end_to_end,
    "interference": interference,
    "syncs": syncs,
    "long_run": long_run,
}


# Issue 34's targets are settled in section 8 by intervals over many rounds, not by this page's run.
ISSUE_34_POINTER = (
    "The end-to-end rows below are the measurements of the page's last full run; issue 34's targets (both torch "
    "threadings, each settled by a 95% interval over many rounds, and the latest figures) are in "
    "[section 8](#8-every-core-busy-torchs-default-threads)."
)


def all_targets(results: dict) -> list[dict]:
    out = []
    for name, module in SECTIONS.items():
        if name in results and hasattr(module, "targets"):
            for t in module.targets(results[name]):
                out.append(t | {"section": name})
    return out


def profiles_needed(targets: list[dict]) -> list[str]:
    missed = {t["section"] for t in targets if not t["met"]}
    which = []
    if "hot_path" in missed:
        which.append("hot_path")
    if missed & {"drain", "end_to_end"}:
        which.append("delivery")
    if missed & {"drain", "hot_path"}:
        which.append("health")
    if "scaling" in missed:
        which.append("tables")
    if "end_to_end" in missed:
        which.append("integration")
    return which


# --- the chart -------------------------------------------------------------------------------------------


def chart(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(18, 10))
    fig.suptitle("rllog benchmarks (lower is better unless noted)", fontsize=14)

    ax = axes[0][0]
    hp = results.get("hot_path", {}).get("rows", [])
    rows = [r for r in hp if "error" not in r]
    if rows:
        labels = [
            r["label"]
            .replace(" (parquet, wandb, trackio, tensorboard, mlflow, comet_ml)", "")
            .replace(" one after the other", "")
            .replace(' (report_to="none")', "")
            .replace(" (no step work between calls)", "")
            .replace(" (parquet, wandb, tensorboard)", "")
            .replace(", log_with=all five", ", five")
            .replace(", report_to=all five", ", five")
            .replace("own API, local server", "own API, server")
            for r in rows
        ]
        colors = [
            "tab:green"
            if r["group"] == "rllog"
            else {"direct": "tab:blue", "accelerate": "tab:orange", "trainer": "tab:red"}[r["group"]]
            for r in rows
        ]
        y = range(len(rows))
        ax.barh(list(y), [r["median_us"] for r in rows], color=colors)
        ax.scatter([r["p99_us"] for r in rows], list(y), marker="|", color="black", s=80, label="p99")
        ax.set_yticks(list(y), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.axvline(hot_path.TARGET_US, color="green", linestyle="--", linewidth=1, label=f"target {hot_path.TARGET_US:.0f} us")
        ax.set_xlabel("us per log call (median bar, p99 tick), log scale")
        ax.set_title("1. Hot path: 30 metrics per call")
        ax.legend(fontsize=7, loc="lower right")

    ax = axes[0][1]
    d = results.get("drain", {}).get("rows", [])
    d = [r for r in d if "error" not in r["rllog"] and "error" not in r["direct"]]
    if d:
        x = range(len(d))
        ax.bar(
            [i - 0.2 for i in x],
            [r["rllog"]["drain_s"] for r in d],
            width=0.4,
            label="rllog: last log -> finish()",
            color="tab:green",
        )
        ax.bar(
            [i + 0.2 for i in x],
            [r["direct"]["total_s"] for r in d],
            width=0.4,
            label="direct: log calls + own finish",
            color="tab:blue",
        )
        for i, r in enumerate(d):
            ax.text(
                i,
                max(r["rllog"]["drain_s"], r["direct"]["total_s"]) * 1.02,
                fmt_ratio(ratio(r["rllog"]["drain_s"], r["direct"]["total_s"])),
                ha="center",
                fontsize=8,
            )
        ax.set_xticks(
            list(x),
            [r["label"].replace(", health rules off", ",\nno health rules") for r in d],
            fontsize=8,
            rotation=30,
            ha="right",
        )
        ax.set_ylabel("seconds")
        ax.set_title(f"2. Drain: {results['drain']['steps']} steps logged back to back")
        ax.legend(fontsize=7)

    ax = axes[0][2]
    e = end_to_end.summary(results["end_to_end"]) if "end_to_end" in results else {}
    if e:
        keys = [k for k in end_to_end.CONFIGS if k in e]
        labels = [
            {
                "a": "(a)\nnone",
                "b": "(b)\ntransformers",
                "c": "(c)\nrllog",
                "c0": "(c)\ncold",
                "cp": "(c)\nparquet only",
                "d": "(d)\nthread",
            }[k]
            for k in keys
        ]
        bars = ax.bar(
            range(len(keys)),
            [e[k]["steady_s"] for k in keys],
            color=[
                {"a": "tab:gray", "b": "tab:red", "c": "tab:green", "c0": "tab:olive", "cp": "tab:cyan", "d": "tab:orange"}[k]
                for k in keys
            ],
        )
        ax.set_xticks(range(len(keys)), labels, fontsize=8)
        base = e.get("a", {}).get("steady_s")
        for bar, k in zip(bars, keys, strict=False):
            ax.text(
                bar.get_x() + bar.get_width() / 2,
                bar.get_height() * 1.01,
                fmt_ratio(ratio(e[k]["steady_s"], base)),
                ha="center",
                fontsize=8,
            )
        if base:
            ax.axhline(base * end_to_end.TARGET, color="green", linestyle="--", linewidth=1, label="target: 1.05x (a)")
            ax.legend(fontsize=7)
        ax.set_ylabel("seconds, steps 3 -> end")
        ax.set_title(
            f"4-5. Tiny GRPO, {results['end_to_end']['steps']} steps: (a) none (b) transformers\n(c) rllog process (c, cold) (d) rllog thread",
            fontsize=10,
        )

    ax = axes[1][0]
    m = results.get("scaling", {}).get("metrics", [])
    for label, color in [("rllog", "tab:green"), ("five", "tab:blue")]:
        pts = sorted((r["n_metrics"], r["median_us"]) for r in m if r["label"].startswith(label) and "error" not in r)
        if pts:
            name = results["scaling"].get("metrics_sinks", "rllog") if label == "rllog" else "five trackers, own APIs"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=color, label=name)
    if m:
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("metrics per log call")
        ax.set_ylabel("us per call (median)")
        ax.set_title("3. Scaling: metrics per step")
        ax.legend(fontsize=7)

    ax = axes[1][1]
    t = scaling.table_ratios(results["scaling"]) if "scaling" in results else []
    if t:
        x = range(len(t))
        ax.bar(
            [i - 0.2 for i in x],
            [r["sink_vs_raw"] for r in t],
            width=0.4,
            color="tab:green",
            label="rllog ParquetSink / raw pyarrow",
        )
        ax.bar(
            [i + 0.2 for i in x],
            [r["full_vs_raw"] for r in t],
            width=0.4,
            color="tab:olive",
            label="whole rllog path / raw pyarrow",
        )
        ax.axhline(scaling.TABLE_TARGET, color="green", linestyle="--", linewidth=1, label="target 0.8x")
        ax.set_xticks(list(x), [f"{r['rows']:,} rows" for r in t])
        ax.set_ylim(0, max(1.3, max(v for r in t for v in (r["sink_vs_raw"], r["full_vs_raw"]) if v == v) * 1.1))
        ax.set_ylabel("throughput ratio (higher is better)")
        ax.set_title("3. Scaling: completions tables")
        ax.legend(fontsize=7)

    ax = axes[1][2]
    ranks = [r for r in results.get("scaling", {}).get("ranks", []) if "error" not in r]
    if ranks:
        x = range(len(ranks))
        ax.bar(
            [i - 0.2 for i in x],
            [r["log"]["median_us"] for r in ranks],
            width=0.4,
            color="tab:green",
            label="rllog log() (reduces across ranks)",
        )
        ax.bar(
            [i + 0.2 for i in x],
            [r["bare_all_reduce"]["median_us"] for r in ranks],
            width=0.4,
            color="tab:blue",
            label="one bare all_reduce",
        )
        ax.set_xticks(list(x), [f"{r['world']} rank(s)" for r in ranks])
        ax.set_yscale("log")
        ax.set_ylabel("us per call (median), rank 0, log scale")
        ax.set_title("3. Scaling: ranks (torchrun, gloo, 2 cores)")
        ax.legend(fontsize=7)

    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# --- the page --------------------------------------------------------------------------------------------


def explain_end_to_end(results: dict, integration: dict | None = None) -> list[str]:
    s = end_to_end.summary(results)
    a, c = s.get("a"), s.get("c")
    if not a or not c:
        return []
    steps = a and results["steps"] - 2
    lines = []
    main_extra = (c["cpu_main_s"] - a["cpu_main_s"]) if c.get("cpu_main_s") == c.get("cpu_main_s") else math.nan
    wall_extra = c["steady_s"] - a["steady_s"]
    lines.append(
        f"In (c) the training thread itself used {fmt(c['cpu_main_s'], 2)} CPU s in the window against {fmt(a['cpu_main_s'], 2)} s in (a) "
        f"({fmt(main_extra * 1e3 / steps, 1)} ms per step more"
        + (
            f"; of which rllog's own code, profiled, is {integration['rllog_ms_per_step']:.2f} ms: the rest is the same training work running "
            "slower while the other core is busy"
            if integration and "rllog_ms_per_step" in integration
            else ""
        )
        + "), while the wall time grew by "
        f"{fmt(wall_extra, 2)} s ({fmt(wall_extra * 1e3 / steps, 1)} ms per step). The delivery agent used {fmt(c.get('cpu_agent_s'), 2)} CPU s "
        f"({fmt((c.get('cpu_agent_s') or math.nan) * 1e3 / steps, 1)} ms per step) delivering to six trackers. On two cores, with the "
        "trackers' own helper processes (wandb-core) and whatever else the machine runs, that CPU is taken from the trainer: the gap "
        "between the training thread's CPU and its wall time is time spent waiting for a core."
    )
    return lines


def findings(results: dict) -> list[str]:
    """What the numbers say about rllog, computed from them (each line only when its data is there)."""
    out = []
    hp = results.get("hot_path")
    if hp:
        six = hot_path.find(hp, "rllog, 6 sinks (")
        b2b = hot_path.find(hp, "rllog, 0 sinks, back to back")
        zero = hot_path.find(hp, "rllog, 0 sinks (")
        five = hot_path.find(hp, "all five, own APIs")
        if six and b2b and zero:
            out.append(
                f"Hot path: {six['median_us']:.0f} us median with six sinks ({zero['median_us']:.0f} us with none): "
                f"{six['median_us'] / hot_path.TARGET_US:.1f}x the 25 us target. Called back to back in a hot loop the same call takes "
                f"{b2b['median_us']:.0f} us; between two steps of work (caches cold, as in training) it is the number above. "
                + (
                    f"Either way it is {five['median_us'] / six['median_us']:,.0f}x less than the five trackers' own calls ({five['median_us'] / 1e3:.1f} ms)."
                    if five
                    else ""
                )
            )
        flat = next((t for t in hot_path.targets(hp) if "flat" in t["what"]), None)
        if flat and not flat["met"]:
            out.append(
                f"Not flat in the number of sinks ({flat['measured']}): `log` runs the same code whatever the sinks (the profile "
                "below), so the difference is the delivery agent's CPU, which grows with the sinks, on the other of the two cores "
                "(with the trackers' helper processes): the calls slow down as the machine gets busier."
            )
        rl = hot_path.find(hp, "Trainer.log + RLLogCallback")
        if rl and rl.get("parts", {}).get("rllog"):
            out.append(
                f"Through the HF Trainer, `RLLogCallback.on_log` costs {rl['parts']['rllog']['median_us']:.0f} us per `Trainer.log` "
                "(it renames the keys and makes one `run.log`, which validates them)."
            )
    sy = results.get("syncs", {}).get("loop")
    if sy:
        item = next((r for r in sy if r["way"] == "item" and "error" not in r), None)
        tens = next((r for r in sy if r["way"] == "tensors" and "error" not in r), None)
        if item and tens:
            out.append(
                f"Tensor metrics: `run.log` of 30 one-element tensors costs {tens['call']['median_us']:.0f} us per call on CPU against "
                f"{item['call']['median_us']:.0f} us for 30 `.item()` calls plus `run.log` of the floats: rllog saves the 30 device syncs "
                "(one `tolist` per journal flush instead); on the caller's thread it checks each tensor's size and stacks them "
                "in one `torch.stack` (`values.stack_scalars`), which on CPU costs more than reading 30 floats."
            )
    e2e = end_to_end.summary(results["end_to_end"]) if "end_to_end" in results else {}
    if e2e.get("a") and e2e.get("c"):
        a, c, cp = e2e["a"], e2e["c"], e2e.get("cp")
        rc = (
            median(end_to_end.round_ratios(results["end_to_end"], "c"))
            if end_to_end.round_ratios(results["end_to_end"], "c")
            else ratio(c["steady_s"], a["steady_s"])
        )
        line = f'End to end, steady steps: the tiny GRPO run with the mixin and six trackers takes {rc:.2f}x the time of `report_to="none"`'
        agent_ms = fmt((c.get("cpu_agent_s") or math.nan) * 1e3 / (results["end_to_end"]["steps"] - 2), 0)
        if cp:
            rp_rounds = end_to_end.round_ratios(results["end_to_end"], "cp")
            rp = median(rp_rounds) if rp_rounds else ratio(cp["steady_s"], a["steady_s"])
            line += f"; the same mixin with only its Parquet default, {rp:.2f}x"
            if rp <= end_to_end.TARGET < rc:
                line += (
                    ". The integration itself is within the target; the rest is the agent's CPU for six trackers "
                    f"({agent_ms} ms per step) competing with the trainer on two cores"
                )
            else:
                line += (
                    f". Both the integration's own work on the training thread and the agent's CPU for six trackers ({agent_ms} ms per step, "
                    "competing with the trainer on two cores) count"
                )
        out.append(line + ". Transformers' (b) does the same tracker work on the training thread itself.")
    drain_missed = [
        r
        for r in results.get("drain", {}).get("rows", [])
        if not r.get("options")
        and "error" not in r["rllog"]
        and "error" not in r["direct"]
        and ratio(r["rllog"]["drain_s"], r["direct"]["total_s"]) > drain.TARGET
    ]
    if drain_missed:
        out.append(
            "Drain misses ("
            + ", ".join(
                f"{r['label']}: {r['rllog']['drain_s']:.2f} s against {r['direct']['total_s']:.2f} s" for r in drain_missed
            )
            + ") are trackers whose own time for the whole burst is a few tenths of a second: rllog's fixed part of a drain (the "
            "journal's last write at `finish`, the agent's next poll and read, closing and the agent's exit) is of the same size, "
            "as the parquet row shows. The delivery profiles below show the rest of the time inside the trackers' own calls "
            "(wandb `run.log` -> `publish_partial_history`; trackio `bulk_log` -> `init_db`)."
        )
    health = results.get("profiles", {}).get("health", {})
    drain_rows = results.get("drain", {}).get("rows", [])
    with_rules = next((r for r in drain_rows if r["label"] == "parquet" and "error" not in r["rllog"]), None)
    without = next((r for r in drain_rows if r.get("options", {}).get("health") is False and "error" not in r["rllog"]), None)
    if health.get("ms_per_step") or (with_rules and without):
        line = "Health rules: "
        if health.get("ms_per_step"):
            line += (
                f"`HealthMonitor.observe` costs {health['ms_per_step']:.2f} ms per logged step of 30 metrics (which rules watch a key "
                "is matched once per key and cached). It runs on the journal writer thread, in the trainer process, holding the GIL, "
                "and the end marker is written only after it. "
            )
        if with_rules and without:
            line += (
                f"The parquet drain of {results['drain']['steps']} steps takes {with_rules['rllog']['drain_s']:.2f} s with the rules and "
                f"{without['rllog']['drain_s']:.2f} s without."
            )
        out.append(line)
    prof = results.get("profiles", {}).get("delivery", {}).get("sinks")
    if prof:
        costs = sorted(((v["cpu_ms_per_step"], k) for k, v in prof.items()), reverse=True)
        line = (
            "Delivery cost per GRPO step and sink (CPU ms, profile below): " + ", ".join(f"{k} {v:.0f}" for v, k in costs) + "."
        )
        calls = next(iter(prof.values())).get("calls_per_step")
        if calls:
            line += (
                f" Reading 16 records (8 steps) at a time, a sink got {calls['write_metrics']:.2f} `write_metrics`, "
                f"{calls['write_table']:.2f} `write_table` and {calls['cursor saves']:.2f} cursor-file saves per step: "
                "`Follower._deliver` gives a batch's metrics to the sink in one call, then its tables; MLflow and trackio "
                "hold rows until `flush` (an MLflow `log_batch` is a SQLite transaction; trackio's `SQLiteStorage.bulk_log` "
                "opens two connections and runs `init_db` per call), which the follower calls every `flush_interval` and when "
                "`Run.flush` asks, so those costs are paid per flush, not per step. A cursor file is rewritten only when the "
                "cursor moved (after a flush, or after a call for a sink whose writes are durable)."
            )
        out.append(line)
    if "scaling" in results:
        t = scaling.table_ratios(results["scaling"])
        cmp = {r["rows"]: r for r in results["scaling"].get("tables", []) if r["kind"] == "tables_compare" and "error" not in r}
        if t and cmp:
            parts = []
            for r in t:
                c = cmp.get(r["rows"])
                if c:
                    close_share = c["close_s"] / (c["count"] + 1) / c["sink_per_table_s"]
                    parts.append(
                        f"{r['rows']:,} rows: {fmt_ratio(r['sink_vs_raw'])} of raw pyarrow's throughput, "
                        f"{fmt_ratio(c['raw']['median_us'] / c['sink']['median_us'])} without the compaction at close "
                        f"(which is {close_share:.0%} of the writer's time)"
                    )
            out.append(
                "Parquet tables: " + "; ".join(parts) + ". Tables go to an Arrow IPC tail per table directory (appended and "
                "committed at each flush), turned into Parquet parts at 262,144 rows and merged in tiers of four as the run goes; "
                "`close` streams the remaining parts into one file. The per-table path adds `to_arrow_table` validation and the "
                "`_step`/`_seq` columns (profile below)."
            )
        ranks = [r for r in results["scaling"].get("ranks", []) if "error" not in r and r["world"] > 1]
        if ranks:
            out.append(
                "Ranks: "
                + "; ".join(
                    f"{r['world']} ranks: `log` {r['log']['median_us'] / 1e3:.1f} ms against {r['bare_all_reduce']['median_us'] / 1e3:.1f} ms "
                    "for one all_reduce"
                    for r in ranks
                )
                + ". `distributed.reduce_metrics` issues two `all_reduce`s per call (sum and count; max, negated min and a new-key "
                "flag) and exchanges key lists only when a rank logs a new key; on this oversubscribed 2-core machine each "
                "collective waits for every rank's process to be scheduled."
            )
    return out


def page(results: dict, meta: dict) -> str:
    targets = all_targets(results)
    out = [
        "# Benchmarks",
        "",
        f"Generated by `.venv/bin/python benchmarks/run.py{' --quick' if meta['quick'] else ''}` on {meta['date']}, "
        f"measuring commit {meta.get('commit', 'unknown')} "
        f"(run time {meta['wall_s'] / 60:.1f} min{'; **quick mode**: fewer calls, steps and configurations' if meta['quick'] else ''}). "
        "Rerun it to refresh this page; `benchmarks/<section>.py [--quick]` runs one section alone and prints its tables.",
        "",
        "Method: every measured configuration runs in its own fresh process, one at a time (never two at once on this 2-core "
        "machine), with every tracker offline and writing under a temporary directory (`rllog.offline.OFFLINE_ENV`, as in the tests). "
        "Times are wall-clock (`perf_counter_ns`); medians and p99 are over the calls of one process, ratios are between medians. "
        "The benchmark's own process waits for each case without waking (a blocking `waitpid`; `Popen.wait` with a timeout "
        "polls every 50 ms, which preempted the measured training thread ~10 times a second). "
        "The machine is shared: the load average below says how busy it was.",
        "",
        "![benchmarks](benchmarks.png)",
        "",
        "## Machine",
        "",
        md_table(
            ["", ""],
            [
                ["CPUs (nproc)", str(meta["machine"]["nproc"])],
                ["CPU", meta["machine"]["cpu"]],
                ["RAM", meta["machine"]["ram"]],
                ["OS", meta["machine"]["os"]],
                ["Python", meta["machine"]["python"]],
                ["load average at start (1/5/15 min)", " / ".join(f"{x:.2f}" for x in meta["machine"]["loadavg"])],
                ["load average at end", " / ".join(f"{x:.2f}" for x in meta["load_end"])],
            ],
        ),
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + ".",
        "",
        "## Targets",
        "",
        ISSUE_34_POINTER,
        "",
        md_table(
            ["section", "target", "wanted", "measured", "result"],
            [
                [
                    t["section"].replace("_", " "),
                    t["what"],
                    t["target"],
                    t["measured"] + (f"; {t['by']}" if t.get("by") else ""),
                    verdict(t["met"]),
                ]
                for t in targets
            ],
        ),
        "",
    ]
    missed = [t for t in targets if t["met"] is False]  # None: not settled by the rounds measured
    if missed:
        out += [
            "**Missed:** "
            + "; ".join(f"{t['what']} ({t['measured']}, wanted {t['target']})" for t in missed)
            + ". The profiles in [Where the time goes](#where-the-time-goes) show why.",
            "",
        ]
    notes = findings(results)
    if notes:
        out += ["## Findings", ""] + [f"- {n}" for n in notes] + [""]
    if "hot_path" in results:
        out += [
            "## 1. Hot path",
            "",
            hot_path.__doc__.strip().split("\n\n")[1].replace("\n", " "),
            "",
            hot_path.render(results["hot_path"]),
            "",
        ]
    if "drain" in results:
        out += ["## 2. Drain", "", drain.render(results["drain"]), ""]
    if "scaling" in results:
        out += ["## 3. Scaling", "", scaling.render(results["scaling"]), ""]
    if "end_to_end" in results:
        out += [
            "## 4. End to end, and 5. delivery in a process against a thread",
            "",
            end_to_end.render(results["end_to_end"]),
            "",
        ]
        out += [*explain_end_to_end(results["end_to_end"], results.get("profiles", {}).get("integration")), ""]
    if "interference" in results:
        out += [
            "### The agent's work beside training, inside one training",
            "",
            " ".join(interference.__doc__.strip().split("\n\n")[1].split()),
            "",
            interference.render(results["interference"]),
            "",
        ]
    if "syncs" in results:
        out += [
            "## 6. Device syncs per logged step",
            "",
            syncs.__doc__.strip().split("\n\n")[0].replace("\n", " "),
            "",
            syncs.render(results["syncs"]),
            "",
        ]
    if "long_run" in results:
        out += ["## 7. The embedded default over a long run", "", long_run.render(results["long_run"]), ""]
    if results.get("profiles"):
        out += [
            "## Where the time goes",
            "",
            "cProfile excerpts for the missed targets (each profiled in its own process; paths shortened).",
            "",
            profiles.render(results["profiles"]),
            "",
        ]
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls, steps and configurations (under 5 minutes)")
    parser.add_argument("--only", help=f"comma-separated sections ({', '.join(SECTIONS)}); default all")
    parser.add_argument("--json", help="also write the raw results to this file")
    parser.add_argument("--no-docs", action="store_true", help="print the tables only; do not write docs/benchmarks.md/png")
    parser.add_argument("--from-json", help="render the page and chart from results saved with --json (no measuring)")
    args = parser.parse_args()
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        return write(saved["results"], saved["meta"], args.no_docs)
    chosen = [s.strip() for s in args.only.split(",")] if args.only else list(SECTIONS)
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    started = time.perf_counter()
    meta = {
        "quick": args.quick,
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "machine": harness.machine(),
        "versions": harness.versions(),
        "commit": git_commit(),
    }
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="rllog-bench-") as tmp:
        tmp = Path(tmp)
        for name in chosen:
            section_start = time.perf_counter()
            if name == "syncs":
                results[name] = syncs.run(args.quick, tmp, results.get("end_to_end", {}).get("runs"))
            else:
                results[name] = SECTIONS[name].run(args.quick, tmp)
            results[name]["wall_s"] = time.perf_counter() - section_start
            progress(f"{name}: {results[name]['wall_s']:.0f} s")
        which = profiles_needed(all_targets(results))
        if args.quick:  # the per-tracker delivery profile opens all six trackers: full run only
            which = [w for w in which if w != "delivery"]
        if which:
            results["profiles"] = profiles.run(args.quick, tmp, which)
    meta["wall_s"] = time.perf_counter() - started
    meta["load_end"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=float))
    return write(results, meta, args.no_docs)


# Parts of docs/benchmarks.md that other commands write (``gpu.py``) or that are written by hand (what was measured
# when every core is busy): a regenerated page keeps them as they are.
KEPT_PARTS = [
    (gpu.SECTION_BEGIN, gpu.SECTION_END),
    ("<!-- every core busy (begin) -->", "<!-- every core busy (end) -->"),
]


def keep_parts(text: str, old: str) -> str:
    """``text`` with the :data:`KEPT_PARTS` of ``old`` (the page it replaces) put back."""
    for begin, end in KEPT_PARTS:
        if begin in old and end in old:
            part = old.split(begin, 1)[1].split(end, 1)[0].strip("\n")
            text = end_to_end.replace_doc_part(text, begin, end, part)
    return text


def write(results: dict, meta: dict, no_docs: bool) -> int:
    page_path = DOCS / "benchmarks.md"
    text = keep_parts(page(results, meta), page_path.read_text() if page_path.exists() else "")
    if not no_docs:
        (DOCS / "benchmarks.md").write_text(text + "\n")
        try:
            chart(results, DOCS / "benchmarks.png")
            long = results.get("long_run", {})
            if "result" in long:
                long_run.write_docs(long["result"], long["samples"])
        except Exception as exc:  # the tables matter more than the pictures
            print(f"chart failed: {exc!r}", file=sys.stderr)
    print(text)
    progress(
        f"done in {meta['wall_s'] / 60:.1f} min"
        + ("" if no_docs else f"; wrote {DOCS / 'benchmarks.md'} and {DOCS / 'benchmarks.png'}")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
