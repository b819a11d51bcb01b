"""Shared pieces of the benchmarks: offline tracker settings, GRPO-shaped metrics, timing statistics,
and the runner that puts every measured configuration in a fresh subprocess.

Every module in ``benchmarks/`` has the same shape:

- ``CASES``: name -> function(params, workdir) -> dict, the code that runs inside one subprocess;
- ``run(quick, tmp) -> dict``: runs its cases one after the other (never two at once: this is a
  2-core machine), each in its own ``python benchmarks/<module>.py --worker CASE`` process;
- ``render(results) -> str``: markdown tables;
- ``python benchmarks/<module>.py [--quick]`` runs it alone and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rllog.delivery.cursor import CursorStore, SinkState
from rllog.offline import OFFLINE_ENV, ONLINE_VARS

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
PLUGINS = ROOT / "tests" / "plugins"  # the test-only entry-point backends (``down``)

# The five trackers transformers and accelerate know, and rllog's six (the five + its parquet default).
FIVE = ["wandb", "tensorboard", "mlflow", "trackio", "comet_ml"]
SIX = ["parquet", "wandb", "trackio", "tensorboard", "mlflow", "comet_ml"]

# 30 metrics with the names TRL 1.16's GRPO logs every step (three reward functions).
GRPO_KEYS = [
    "loss", "grad_norm", "learning_rate", "num_tokens", "kl", "entropy", "reward", "reward_std", "frac_reward_zero_std",
    "completions/mean_length", "completions/min_length", "completions/max_length", "completions/clipped_ratio",
    "completions/mean_terminated_length", "completions/min_terminated_length", "completions/max_terminated_length",
    "rewards/accuracy/mean", "rewards/accuracy/std", "rewards/format/mean", "rewards/format/std",
    "rewards/length/mean", "rewards/length/std",
    "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max",
    "step_time", "epoch", "train_tokens_per_second",
]  # fmt: skip
assert len(GRPO_KEYS) == 30


def metric_keys(n: int) -> list[str]:
    """``n`` metric names: the GRPO ones first, then more reward-function-shaped names."""
    extra = [f"rewards/fn{i // 2:03d}/{'mean' if i % 2 == 0 else 'std'}" for i in range(max(0, n - len(GRPO_KEYS)))]
    return (GRPO_KEYS + extra)[:n]


def grpo_metrics(step: int, n: int = 30, seed: int = 0) -> dict[str, float]:
    """One step's metrics: plausible, healthy GRPO values (rllog's health rules stay quiet) that change every
    step, so no tracker can deduplicate them."""
    rng = random.Random(seed * 1_000_003 + step)
    p = (step % 1000) / 1000
    length = 60 + 20 * p + rng.gauss(0, 3)
    known = {
        "loss": rng.gauss(0.0, 0.02), "grad_norm": abs(rng.gauss(0.8, 0.2)), "learning_rate": 1e-6 * (1 - p), "num_tokens": float((step + 1) * 4096),
        "kl": 0.01 + 0.01 * p + abs(rng.gauss(0, 0.001)), "entropy": 2.0 - 0.2 * p + rng.gauss(0, 0.02),
        "reward": 0.2 + 0.5 * p + rng.gauss(0, 0.03), "reward_std": abs(rng.gauss(0.3, 0.05)), "frac_reward_zero_std": 0.2 + rng.gauss(0, 0.02),
        "completions/mean_length": length, "completions/min_length": length - 30, "completions/max_length": length + 60,
        "completions/clipped_ratio": 0.05 + abs(rng.gauss(0, 0.01)), "completions/mean_terminated_length": length - 5,
        "completions/min_terminated_length": length - 35, "completions/max_terminated_length": length + 40,
        "clip_ratio/low_mean": abs(rng.gauss(0.01, 0.003)), "clip_ratio/high_mean": abs(rng.gauss(0.02, 0.003)),
        "clip_ratio/region_mean": abs(rng.gauss(0.03, 0.003)), "clip_ratio/low_min": 0.0, "clip_ratio/high_max": abs(rng.gauss(0.05, 0.01)),
        "step_time": 0.5 + rng.random() * 0.1, "epoch": p * 3, "train_tokens_per_second": 8000 + rng.gauss(0, 100),
    }  # fmt: skip
    return {
        k: known[k] if k in known else (rng.random() if k.endswith("/mean") else abs(rng.gauss(0.3, 0.05)))
        for k in metric_keys(n)
    }


class StepWork:
    """Stand-in for a training step between two ``log`` calls: ``ms`` of matrix products on this thread.

    Like a framework's kernels it keeps the core busy and releases the GIL (so background threads run
    as they would during training); a ``time.sleep`` instead would let the (virtual) CPU go idle and
    charge the next call for waking it up.
    """

    def __init__(self, ms: float):
        import numpy as np

        self.a = np.random.default_rng(0).random((160, 160))
        self.repeats = 0
        if ms > 0:
            t = time.perf_counter()
            for _ in range(20):
                self.a @ self.a
            one = (time.perf_counter() - t) / 20
            self.repeats = max(1, round(ms / 1e3 / one))

    def __call__(self) -> None:
        for _ in range(self.repeats):
            self.a @ self.a


# --- the environment every benchmark process runs in ------------------------------------------------

# One torch thread: the trainer gets one core, the delivery agent and the trackers the other (the GPU-like case,
# where training leaves the CPUs mostly idle). ``threads="default"`` leaves these out: torch then uses every core,
# as a user's script does.
PINNED_THREADS = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
THREAD_MODES = ("one", "default")
OFFLINE = {**OFFLINE_ENV, "PYTHONWARNINGS": "ignore"}
# PYTHONDONTWRITEBYTECODE (set by some sandboxes) would have every benchmark process compile rllog's modules anew, as
# rllog is installed editable here: a user's rllog, like every package pip installs, imports from compiled bytecode.
DROP = (*ONLINE_VARS, "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "PYTHONDONTWRITEBYTECODE")


def offline_env(workdir: Path, plugins: bool = False, threads: str = "one") -> dict[str, str]:
    """The environment of one benchmark process: offline trackers, all storage under ``workdir``; torch pinned to
    one thread unless ``threads="default"``."""
    if threads not in THREAD_MODES:
        raise ValueError(f"threads must be one of {THREAD_MODES}, not {threads!r}")
    env = {k: v for k, v in os.environ.items() if k not in DROP and k not in PINNED_THREADS}
    env.update(OFFLINE)
    if threads == "one":
        env.update(PINNED_THREADS)
    dirs = {
        "WANDB_DIR": "wandb_dir", "WANDB_CACHE_DIR": "wandb_cache", "WANDB_DATA_DIR": "wandb_data", "WANDB_CONFIG_DIR": "wandb_config",
        "TRACKIO_DIR": "trackio", "COMET_OFFLINE_DIRECTORY": "comet", "TENSORBOARD_LOGGING_DIR": "tensorboard", "RLLOG_DIR": "rllog_runs",
        "HF_HOME": "hf_home", "MPLCONFIGDIR": "mpl",
    }  # fmt: skip
    for key, name in dirs.items():
        (workdir / name).mkdir(parents=True, exist_ok=True)
        env[key] = str(workdir / name)
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{workdir / 'mlflow.db'}"
    env["MLFLOW_ARTIFACT_ROOT"] = str(workdir / "mlartifacts")
    paths = [str(ROOT), str(BENCH)] + ([str(PLUGINS)] if plugins else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return env


def block_comet_probe() -> None:
    """comet_ml probes the cloud metadata address when an experiment starts; no setting stops it."""
    import comet_ml.experiment

    comet_ml.experiment.get_env_cloud_details = lambda *a, **k: None


# --- statistics ----------------------------------------------------------------------------------------


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    k = (len(sorted_values) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def summarize_ns(samples_ns: list[int]) -> dict[str, float]:
    """Median, p99, mean (microseconds) of per-call times in nanoseconds."""
    s = sorted(samples_ns)
    return {
        "n": len(s),
        "median_us": percentile(s, 0.5) / 1e3,
        "p99_us": percentile(s, 0.99) / 1e3,
        "mean_us": (sum(s) / len(s) / 1e3) if s else math.nan,
        "max_us": (s[-1] / 1e3) if s else math.nan,
    }


def median(values: list[float]) -> float:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(values) if values else math.nan


def geometric_mean_interval(ratios: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """The geometric mean of ``ratios`` (per-round ratios of two configurations) and its ``level`` confidence interval:
    Student's t on the logarithms, which widens as rounds get few (this machine's rounds spread ~15%, so three
    rounds rarely settle a few percent). A geometric mean, as 1.1x and 1/1.1x cancel."""
    from scipy.stats import t  # the benchmarks' environment has it (mlflow needs it); the library does not

    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), 0.0, math.inf
    half = float(t.ppf((1 + level) / 2, len(logs) - 1)) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


ROUNDS_LISTED = 12  # more rounds than this are counted, not listed


def interval_verdict(ratios: list[float], limit: float) -> tuple[bool | None, str]:
    """Whether per-round ratios meet ``<= limit``: met when their 95% interval lies at or below it, missed when it lies
    above, else not settled (None); and the measurement as text."""
    mean, low, high = geometric_mean_interval(ratios)
    met = True if high <= limit else False if low > limit else None
    rounds = ", ".join(f"{x:.2f}" for x in ratios) if len(ratios) <= ROUNDS_LISTED else f"{len(ratios)}"
    # three decimals: a verdict near the limit (an interval ending at 1.0296 against 1.03) must read as what it is
    return met, f"{mean:.3f}x, 95% interval {low:.3f}-{high:.3f} (rounds: {rounds})"


def verdict(met: bool | None) -> str:
    return "**not settled**" if met is None else ("**met**" if met else "**MISSED**")


def ratio(a: float | None, b: float | None) -> float:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return math.nan
    return a / b


# --- one configuration, one process ------------------------------------------------------------------


def run_case(
    script: Path,
    case: str,
    params: dict | None,
    tmp: Path,
    *,
    plugins: bool = False,
    timeout: float = 900.0,
    command: list[str] | None = None,
    env_extra: dict | None = None,
    threads: str = "one",
) -> dict:
    """Run ``case`` of ``script`` in a fresh process (its own work dir under ``tmp``); return its JSON result.

    ``threads``: ``"one"`` pins torch (and BLAS) to one thread, ``"default"`` leaves torch's defaults (every core).
    A case that fails returns ``{"error": ...}`` (the tail of its output) instead of stopping the benchmarks.
    """
    workdir = Path(tempfile.mkdtemp(prefix=f"{case}-", dir=tmp))
    out = workdir / "result.json"
    env = offline_env(workdir, plugins=plugins, threads=threads) | (env_extra or {})
    base = command or [sys.executable, str(script)]
    cmd = [*base, "--worker", case, "--params", json.dumps(params or {}), "--out", str(out), "--workdir", str(workdir)]
    log_path = workdir / "output.log"
    started = time.perf_counter()
    with open(log_path, "wb") as log:
        code: int | str = wait_without_polling(
            subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir), timeout
        )
    wall = time.perf_counter() - started
    if code == 0 and out.exists():
        result = json.loads(out.read_text())
        result.setdefault("process_wall_s", wall)
        return result
    tail = log_path.read_text(errors="replace")[-3000:] if log_path.exists() else ""
    print(f"  !! {script.name} {case} {params or ''} failed ({code}); log: {log_path}\n{tail[-1500:]}", file=sys.stderr)
    return {"error": f"exit {code}", "log": str(log_path), "process_wall_s": wall}


def wait_without_polling(proc: subprocess.Popen, timeout: float) -> int | str:
    """``proc``'s exit code, or ``"timeout"`` once it ran ``timeout`` seconds (then it is killed).

    ``Popen.wait(timeout)`` polls every 50 ms: on a busy machine that wake-up preempted the measured process's
    training thread ~10 times a second (a ``sched_switch`` trace of a 240-step run: 258 times). Here a timer kills
    a case that runs too long, and the wait itself blocks in ``waitpid``."""
    expired = threading.Event()

    def kill() -> None:
        expired.set()
        proc.kill()

    timer = threading.Timer(timeout, kill)
    timer.start()
    try:
        code = proc.wait()
    except BaseException:  # an interrupted benchmark leaves no case running (as subprocess.run)
        proc.kill()
        raise
    finally:
        timer.cancel()
    return "timeout" if expired.is_set() else code


def worker_main(cases: dict[str, Callable[[dict, Path], dict]], argv: list[str] | None = None) -> None:
    """The ``--worker CASE`` entry point of a module: run one case, write its result as JSON."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True)
    parser.add_argument("--params", default="{}")
    parser.add_argument("--out", required=True)
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args(argv)
    try:
        result = cases[args.worker](json.loads(args.params), Path(args.workdir))
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)
    if result is not None:  # None: a torchrun rank other than 0
        Path(args.out).write_text(json.dumps(result, default=float))
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit: a tracker's leftover non-daemon thread must not hold the benchmark up (results are written).
    os._exit(0)


def module_main(run: Callable[[bool, Path], dict], render: Callable[[dict], str], cases: dict, doc: str | None = None) -> None:
    """``python benchmarks/<module>.py [--quick] [--json PATH]``, or ``--worker CASE`` (internal)."""
    if "--worker" in sys.argv:
        worker_main(cases)
        return
    parser = argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0] if doc else None)
    parser.add_argument(
        "--quick", action="store_true", help="fewer calls, steps and configurations (minutes, not tens of minutes)"
    )
    parser.add_argument("--json", help="also write the raw results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rllog-bench-") as tmp:
        started = time.perf_counter()
        results = run(args.quick, Path(tmp))
        results["wall_s"] = time.perf_counter() - started
    print(render(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=float))


def git_commit() -> str:
    """The commit measured, and whether rllog's code differed from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "rllog", "rllog_backends"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (" (with uncommitted changes in rllog/)" if dirty else "") if head else "unknown"


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def rounds_within(rounds: int, budget: float | None, since: float | None = None) -> Iterator[int]:
    """``range(rounds)``, cut short for a lent machine's time limit: with ``budget`` (seconds from ``since``, default
    the first round's start), no round is started that the last one's duration says would not fit what is left; a
    round cut off by the limit would lose the rounds already done with it."""
    started = time.perf_counter() if since is None else since
    last = 0.0
    for round_ in range(rounds):
        left = budget - (time.perf_counter() - started) if budget else None
        if left is not None and round_ and last > left:
            progress(f"{round_} round(s) done; the next (~{last:.0f} s) does not fit the {left:.0f} s left")
            return
        began = time.perf_counter()
        yield round_
        last = time.perf_counter() - began


# --- rllog helpers (used inside workers) -----------------------------------------------------------


def delivered(run_dir: Path, sink: str) -> int:
    return CursorStore(run_dir, sink).load().seq


SETTLE_S = 2.0


def wait_delivered(run_dir: Path, sinks: list[str], seq: int, timeout: float = 120.0, settle: float = 0.0) -> float:
    """Wait until every sink's cursor reached ``seq``, then ``settle`` seconds more (the sinks' first flush,
    and its one-time costs, e.g. pyarrow importing pandas, happen then); returns the seconds until delivered."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if all(delivered(run_dir, s) >= seq for s in sinks):
            waited = time.monotonic() - started
            time.sleep(settle)
            return waited
        failed = {s: c.error for s in sinks if (c := CursorStore(run_dir, s).load()).state in SinkState.BROKEN}
        if failed:  # a permanent failure (a tracker missing a module, say) never delivers: say so now
            raise RuntimeError(f"sinks failed before seq {seq}: {failed}")
        time.sleep(0.02)
    raise TimeoutError(f"sinks {sinks} did not reach seq {seq} in {timeout}s: {[delivered(run_dir, s) for s in sinks]}")


# --- markdown ------------------------------------------------------------------------------------------


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, float) and math.isnan(value):
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.{digits}f}"


def fmt_ratio(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if value >= 100:
        return f"{value:,.0f}x"
    return f"{value:.2f}x" if value < 10 else f"{value:.1f}x"


def md_table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(fmt(c) if not isinstance(c, str) else c for c in row) + " |")
    return "\n".join(lines)


def machine() -> dict:
    """nproc, CPU model, RAM, OS, Python, load average."""
    cpu = "?"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = "?"
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                ram = f"{int(line.split()[1]) / 2**20:.1f} GiB"
                break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "ram": ram,
        "os": platform.platform(),
        "python": platform.python_version(),
        "loadavg": os.getloadavg(),
    }


PACKAGES = [
    "rllog",
    "torch",
    "trl",
    "transformers",
    "accelerate",
    "datasets",
    "wandb",
    "trackio",
    "tensorboard",
    "mlflow",
    "comet_ml",
    "pyarrow",
    "numpy",
    "matplotlib",
]


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out
