"""Soak: run N fault schedules (tests/fault_schedules.py) with seeds S, S+1, ... and count invariant violations.

    .venv/bin/python benchmarks/soak.py --schedules 200 --seed 1000 [--shrink] [--write-docs] [--results FILE]

Each schedule is a real run (a trainer subprocess, the delivery agent, parquet + TensorBoard + the test jsonl
sink, a run dir on a real tmpfs) with real faults; it needs root (the tmpfs). Prints one line per schedule,
then the seed, schedule and (with ``--shrink``) the shrunk schedule of the first violation of each invariant,
and ends with the line ``N schedules, F faults, V invariant violations`` (V: schedule x invariant pairs).
``--write-docs`` writes what was explored to docs/reliability-soak.md (schedules, fault kinds with counts,
invariant checks with counts, violations with seeds).
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import fault_schedules as fs  # noqa: E402

DOCS = ROOT / "docs" / "reliability-soak.md"
SHRINK_RUNS = 10  # schedules run to shrink one violation (each ~10 s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedules", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shrink", action="store_true", help="shrink the first violation of each invariant")
    parser.add_argument("--write-docs", action="store_true", help=f"write {DOCS.relative_to(ROOT)}")
    parser.add_argument("--results", type=Path, default=None, help="append one JSON line per schedule here")
    parser.add_argument("--keep", action="store_true", help="keep the work directories of failing schedules")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the trainer killed, the tmpfs unmounted
    if args.schedules < 1:
        parser.error("--schedules must be at least 1")

    faults: collections.Counter = collections.Counter()
    checks: collections.Counter = collections.Counter()
    violated: dict[str, list[tuple[int, str]]] = collections.defaultdict(list)  # invariant -> [(seed, detail)]
    first: dict[str, fs.Schedule] = {}
    began = time.monotonic()
    base = Path(tempfile.mkdtemp(prefix="rllog-soak-"))
    try:
        for seed in range(args.seed, args.seed + args.schedules):
            schedule = fs.generate(seed)
            workdir = base / f"s{seed}"
            outcome = fs.run_schedule(schedule, workdir)
            faults.update(f.kind for f in schedule.faults)
            checks.update(outcome.checks)
            for v in outcome.violations:
                if all(s != seed for s, _ in violated[v.invariant]):
                    violated[v.invariant].append((seed, v.detail))
                first.setdefault(v.invariant, schedule)
            verdict = "ok" if not outcome.violations else "VIOLATED " + ", ".join(sorted(outcome.keys))
            print(f"[{outcome.seconds:5.1f}s] {schedule.describe()} -> {verdict}", flush=True)
            for v in outcome.violations:
                print(f"    {v}", flush=True)
            if args.results:
                with open(args.results, "a") as f:
                    f.write(
                        json.dumps(
                            {
                                "seed": seed,
                                "schedule": schedule.describe(),
                                # the schedule itself: rerun with fs.Schedule.from_json after FAULT_KINDS changed
                                "spec": json.loads(schedule.as_json()),
                                "seconds": round(outcome.seconds, 1),
                                "faults": [f.kind for f in schedule.faults],
                                "checks": dict(outcome.checks),
                                "violations": [[v.invariant, v.detail] for v in outcome.violations],
                            }
                        )
                        + "\n"
                    )
            if not (args.keep and outcome.violations):
                shutil.rmtree(workdir, ignore_errors=True)
        shrunk: dict[str, fs.Schedule] = {}
        if args.shrink:
            for invariant, schedule in first.items():
                print(f"shrinking {invariant} from {schedule.describe()}", flush=True)
                shrunk[invariant] = fs.shrink(schedule, invariant, base / f"shrink-{invariant}", SHRINK_RUNS, print)
    finally:
        if args.keep:
            print(f"kept the work directories of failing schedules in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    elapsed = time.monotonic() - began
    count = sum(len(seeds) for seeds in violated.values())
    for invariant, seeds in sorted(violated.items()):
        print(f"{invariant}: {len(seeds)} schedules, seeds {[s for s, _ in seeds][:20]}")
        print(f"    first: {first[invariant].describe()}")
        if invariant in shrunk:
            print(f"    shrunk: {shrunk[invariant].describe()}")
        print(f"    {seeds[0][1]}")
    if args.write_docs:
        write_docs(args, faults, checks, violated, first, shrunk, elapsed)
    print(f"{args.schedules} schedules, {sum(faults.values())} faults, {count} invariant violations")
    return 0


def write_docs(args, faults, checks, violated, first, shrunk, elapsed) -> None:
    lines = [
        "# Fault-schedule soak",
        "",
        f"Written by `benchmarks/soak.py --schedules {args.schedules} --seed {args.seed}"
        f"{' --shrink' if args.shrink else ''} --write-docs` ({elapsed / 60:.0f} min). Each schedule is a real run from "
        "its seed (tests/fault_schedules.py): a trainer subprocess logging to parquet, TensorBoard and the test jsonl "
        "sink, its run dir on a real tmpfs, with the faults below applied at random record indexes; then the "
        "invariants of docs/guarantees.md checked against the journal, the report and each sink's own storage, "
        "`rllog replay` run for what was pending, and run again to check that it sends nothing twice.",
        "",
        f"{args.schedules} schedules (seeds {args.seed}-{args.seed + args.schedules - 1}), "
        f"{sum(faults.values())} faults, {sum(len(s) for s in violated.values())} invariant violations.",
        "",
        "| fault kind | injected |",
        "|---|---|",
        *[f"| `{kind}` | {faults[kind]} |" for kind in fs.ALL_KINDS],
        "",
        "| invariant | checked | violated (schedules) | seeds |",
        "|---|---|---|---|",
        *[
            f"| `{name}`: {text} | {checks[name]} | {len(violated.get(name, []))} | "
            f"{', '.join(str(s) for s, _ in violated.get(name, [])[:12])} |"
            for name, text in fs.INVARIANTS.items()
        ],
        "",
    ]
    if violated:
        lines += ["## Violations", ""]
        for invariant, seeds in sorted(violated.items()):
            lines.append(f"- `{invariant}` (seed {seeds[0][0]}): {first[invariant].describe()}")
            if invariant in shrunk:
                lines.append(f"  shrunk to: {shrunk[invariant].describe()}")
            lines.append("  " + " ".join(seeds[0][1].split())[:400])
        lines.append("")
    DOCS.write_text("\n".join(lines))
    print(f"wrote {DOCS}")


if __name__ == "__main__":
    sys.exit(main())
