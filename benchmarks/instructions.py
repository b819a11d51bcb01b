"""Trainer-side instructions: what the rllog mixin adds to the training process, counted, not timed.

This machine's timings swing by 30% between identical runs; valgrind's callgrind counts the instructions each
thread of a process executes, the same for the same work whatever else the machine does. The tiny GRPO run of
``end_to_end.py`` (fresh process, one torch thread) runs under callgrind at two lengths, with (a)
``report_to="none"`` and with (c0p) the mixin, five trackers + parquet and ``rllog.prepare`` at the top of the
script; the delivery agent is a child process, not traced (``--trace-children=no``). The difference between the
two lengths is the per-step cost without start-up; (c0p) / (a) per step is the mixin's share of the training
process's work (main thread, and all threads: the journal writer runs beside the training thread).

Caveat: under callgrind a step takes ~50x longer, so threads that wake on a timer (the journal writer every 50 ms,
the agent watcher every 0.2 s) wake ~50x more often per step than in a real run: the "all threads" figure is an
upper bound; the main thread's is exact.

    .venv/bin/python benchmarks/instructions.py [SHORT LONG]   # default 10 30 steps; ~10 minutes on 2 cores
"""

from __future__ import annotations

import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness import run_case

SCRIPT = Path(__file__).resolve().parent / "end_to_end.py"
CONFIGS = {"a": {"mode": "none"}, "c0p": {"mode": "rllog", "delivery": "process", "warm": False, "prepare": True}}


def counted(key: str, steps: int, tmp: Path) -> dict[str, int]:
    """Instructions per thread ("main" and "all") of one fresh-process training under callgrind."""
    out = Path(tempfile.mkdtemp(prefix=f"cg-{key}-{steps}-", dir=tmp)) / "callgrind.out"
    valgrind = ["valgrind", "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={out}"]
    result = run_case(
        SCRIPT, "grpo", CONFIGS[key] | {"steps": steps}, tmp, timeout=3600, command=[*valgrind, sys.executable, str(SCRIPT)]
    )
    if "error" in result:
        raise RuntimeError(f"{key}, {steps} steps under callgrind failed: {result['log']}")
    threads = {}
    for path in out.parent.glob("callgrind.out-*"):  # one file per thread: callgrind.out-01 is the main thread
        summary = next(line for line in path.read_text(errors="replace").splitlines() if line.startswith("summary:"))
        threads[path.name.rsplit("-", 1)[1]] = int(summary.split()[1])
    return {"main": threads["01"], "all": sum(threads.values())}


def main() -> None:
    short, long = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (10, 30)
    if not 3 <= short < long:  # end_to_end's timed window starts at step 3
        sys.exit(f"usage: instructions.py [SHORT LONG] with 3 <= SHORT < LONG, got {short} {long}")
    tmp = Path(tempfile.mkdtemp(prefix="rllog-instructions-"))
    jobs = [(key, steps) for steps in (short, long) for key in CONFIGS]
    with ThreadPoolExecutor(max_workers=2) as pool:  # callgrind runs one thread at a time: one run per core
        counts = dict(zip(jobs, pool.map(lambda job: counted(*job, tmp), jobs), strict=True))
    for part in ("main", "all"):
        per_step = {key: (counts[key, long][part] - counts[key, short][part]) / (long - short) for key in CONFIGS}
        print(
            f"{part:>4} threads: (a) {per_step['a'] / 1e6:.1f}M instructions a step, (c0p) {per_step['c0p'] / 1e6:.1f}M: "
            f"{per_step['c0p'] / per_step['a']:.3f}x"
        )


if __name__ == "__main__":
    main()
