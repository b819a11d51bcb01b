"""The ``rllog`` command: ``runs``, ``show``, ``plot``, ``replay``, ``backends``, ``demo``.

Every error is one ``error:`` line on stderr saying what to do, and exit status 2.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rllog.errors import RllogError

if TYPE_CHECKING:
    from rllog.records import AlertRecord
    from rllog.summary import RunSummary

# Piped output (CI logs, `| less`) gets 120 columns rather than Rich's 80, so metric names fit on one line, and its
# text lines are never broken: a long path cut in two cannot be pasted (tables still fit the width).
_piped = not sys.stdout.isatty()
console = Console(width=120 if _piped and "COLUMNS" not in os.environ else None, soft_wrap=_piped)
# Notes (which run was picked) and errors go to stderr, so that piped output holds only what was asked for.
notes = Console(stderr=True, soft_wrap=True)  # one line per note or error, however long: greppable
EXIT_USAGE = 2  # an error the user can fix: the message says how


class CliError(Exception):
    """An error printed as one ``error:`` line."""


def _started(run_dir: Path) -> float:
    from rllog.rundir import RunFile

    try:
        return RunFile.read(run_dir).started or 0.0
    except (OSError, ValueError, TypeError, KeyError):
        return 0.0


def runs_under(folder: Path) -> list[Path]:
    """The run directories directly under ``folder``, oldest first (by the time each run started)."""
    from rllog.rundir import RUN_FILE

    found = [p for p in folder.iterdir() if (p / RUN_FILE).is_file()] if folder.is_dir() else []
    return sorted(found, key=lambda p: (_started(p), p.name))


def resolve_run(given: str | None) -> Path:
    """The run ``given`` names: a run directory; a folder of runs (its latest, said on stderr); nothing (the latest
    under ``$RLLOG_DIR`` or ``rllog_runs``)."""
    from rllog.rundir import RUN_FILE
    from rllog.settings import RUNS_DIR

    folder = Path(given) if given is not None else RUNS_DIR.get()
    if given is not None and (folder / RUN_FILE).is_file():
        return folder
    if not folder.exists():
        raise CliError(f"{folder} does not exist; `rllog runs DIR` lists the runs under a folder")
    runs = runs_under(folder)
    if not runs:
        where = "" if given is not None else " (set RLLOG_DIR, or pass a run directory)"
        raise CliError(f"{folder} holds no rllog run{where}")
    if len(runs) > 1 or given is None:
        notes.print(
            f"{escape(str(folder))} holds {len(runs)} run{'s' if len(runs) > 1 else ''}; using the latest, "
            f"[bold]{escape(runs[-1].name)}[/bold] (`rllog runs {escape(str(folder))}` lists them)"
        )
    return runs[-1]


def run_status(run_dir: Path) -> str:
    from rllog.read import run_status as status

    return status(run_dir)


def _fmt(value: float) -> str:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return str(value)
    return f"{value:.6g}"


def cmd_backends(args) -> int:
    from rllog.registry import ALIASES, BUILT_IN, backends

    table = Table(title="rllog backends")
    for col in ("name", "source", "installed", "install with"):
        table.add_column(col)
    for name, b in backends().items():
        aliases = [a for a, target in ALIASES.items() if target == name]
        label = name + (f" (alias: {', '.join(aliases)})" if aliases else "")
        available = b.installed
        problem = b.problem() if available and b.requires is None and b.source != BUILT_IN else None
        table.add_row(
            label,
            b.source,
            escape(f"no: {problem}") if problem else "yes" if available else "no",
            escape(f"pip install 'rllog[{b.extra}]'") if b.extra and not available else "",
        )
    console.print(table)
    return 0


def cmd_runs(args) -> int:
    import datetime

    from rllog.journal import last_step
    from rllog.rundir import RunFile
    from rllog.settings import RUNS_DIR

    folder = Path(args.dir) if args.dir else RUNS_DIR.get()
    runs = runs_under(folder)
    if not runs:
        raise CliError(f"{folder} holds no rllog run" + ("" if folder.exists() else " (it does not exist)"))
    table = Table(title=f"runs under {escape(str(folder))}")
    for col in ("run", "name", "status", "last step", "trackers", "started"):
        table.add_column(col, overflow="fold")
    for run_dir in runs:
        info = RunFile.read(run_dir)
        started = datetime.datetime.fromtimestamp(info.started).strftime("%Y-%m-%d %H:%M") if info.started else ""
        step = last_step(run_dir)
        trackers = ", ".join(s.name for s in info.sinks) or "none"
        table.add_row(
            escape(run_dir.name), escape(info.name), run_status(run_dir), str(step) if step >= 0 else "-", trackers, started
        )
    console.print(table)
    return 0


def cmd_show(args) -> int:
    from rllog.summary import summarise

    run_dir = resolve_run(args.run_dir)
    show_run(run_dir, summarise(run_dir))
    return 0


def show_run(run_dir: str | os.PathLike, s: RunSummary) -> None:
    """Print a run: its identity, per-metric last/min/max and health, alerts, tables and each sink's delivery state."""
    from rllog.rundir import DELIVERED, FAILED, PENDING, load_run_info, report

    info, _ = load_run_info(run_dir)
    steps = f"{min(s.steps)}..{max(s.steps)} ({len(s.steps)} distinct)" if s.steps else "none"
    status = s.status or run_status(Path(run_dir))
    console.print(f"[bold]{escape(info.project)} / {escape(info.name)}[/bold]  run_id={info.run_id}  status={status}")
    console.print(f"{escape(str(run_dir))}\nrecords: {s.records}   steps: {steps}")
    _print_metrics(s)
    _print_alerts(s.alerts)
    for name, (n, rows) in sorted(s.tables.items()):
        console.print(f"table [bold]{escape(name)}[/bold]: logged {n} times, {rows} rows")
    live = "the run is live: its delivery agent is delivering (`rllog show` again to follow)"
    delivery = report(run_dir, cause=live if status == "running" else None)
    for r in delivery.values():
        colour = {DELIVERED: "green", PENDING: "yellow", FAILED: "red"}[r.state]
        error = ": " + escape(r.error) if r.error else ""
        counts = (
            f"({r.delivered} delivered, {r.pending} pending"
            + (f", {r.dead_letters} dead-lettered" if r.dead_letters else "")
            + ")"
        )
        console.print(f"sink [bold]{r.name}[/bold]: [{colour}]{r.state}[/{colour}] {counts}{error}")
        if r.location:  # rllog.rundir.tracker_location: what the backend recorded in RUN_DIR/trackers/<sink>.json
            console.print(f"  data: {escape(r.location)}")
        for letter in r.dead_letter_list[:10]:
            console.print(
                f"  [red]dead letter[/red] seq {letter['seq']} step {letter['step']} ({letter['kind']}): {escape(str(letter['error']))}"
            )
    if delivery.journal_damage:
        console.print(f"[red]journal:[/red] {delivery.journal_damage.describe()}")


def _print_metrics(s: RunSummary) -> None:
    """The metrics table (unhealthy last values in red), then an explanation of each unhealthy metric."""
    from rllog.catalog import crucial_keys, explain, health

    table = Table(title="metrics")
    table.add_column("metric", overflow="fold")
    for col in ("last", "min", "max", "count"):
        table.add_column(col, justify="right")
    table.add_column("health")
    unhealthy: list[str] = []
    crucial = crucial_keys(s.metrics)
    for key in crucial + sorted(set(s.metrics) - set(crucial)):  # the metrics to watch first, then the rest by name
        m = s.metrics[key]
        extra = f" ({m.non_finite} NaN/inf)" if m.non_finite else ""
        state = health(key, m.last)
        if state == "unhealthy":
            unhealthy.append(key)
        mark = {"ok": "[green]ok[/green]", "unhealthy": "[bold red]UNHEALTHY[/bold red]"}.get(state or "", "")
        label = f"[bold red]{escape(key)}[/bold red]" if state == "unhealthy" else escape(key)
        low, high = _fmt(m.min) if m.min != math.inf else "-", _fmt(m.max) if m.max != -math.inf else "-"
        table.add_row(label, _fmt(m.last), low, high, f"{m.count}{extra}", mark)
    console.print(table)
    for key in unhealthy:
        m = s.metrics[key]
        why = escape(explain(key, m.last) or "")
        console.print(f"[bold red]unhealthy[/bold red] [bold]{escape(key)}[/bold] = {_fmt(m.last)} at step {m.last_step}: {why}")


def _print_alerts(alerts: list[AlertRecord]) -> None:
    """How many alerts each rule raised, and the latest five."""
    if not alerts:
        return
    by_rule = Counter(a.rule for a in alerts)
    console.print(f"[bold]alerts[/bold]: {len(alerts)} ({', '.join(f'{r} x{n}' for r, n in sorted(by_rule.items()))}); latest:")
    for a in alerts[-5:]:
        colour = "red" if a.level == "error" else "yellow"
        what = f"{a.level.upper()} {escape('[' + a.rule + ']')} {escape(a.metric)}={_fmt(a.value)}: {escape(a.message)}"
        console.print(f"  [{colour}]step {a.step} {what}[/{colour}]")


def cmd_plot(args) -> int:
    try:
        import matplotlib  # noqa: F401  (only to say what to install)
    except ModuleNotFoundError:
        raise CliError('`rllog plot` needs matplotlib: pip install "rllog[plot]"') from None
    from rllog.plot import plot_runs

    if not 0 <= args.smooth < 1:
        raise CliError(f"--smooth {args.smooth}: give a weight in [0, 1) (0: none, 0.9: heavy)")
    runs = [resolve_run(r) for r in args.runs] if args.runs else [resolve_run(None)]
    out = plot_runs(runs, args.output, args.metrics.split(",") if args.metrics else None, smooth=args.smooth)
    console.print(f"wrote {out}")
    return 0


EXIT_BUSY = 75  # EX_TEMPFAIL: another process is delivering to that sink of that run; try again later


def _repair_parquet(run_dir: str) -> None:
    """Finish what an agent killed inside the Parquet store's close-time merge left, holding the sink's lock (a
    replay with nothing to deliver never opens the sink)."""
    from rllog.delivery import CursorStore, SinkState
    from rllog_backends.parquet import repair, store_dir

    directory = store_dir(run_dir)
    if not directory.is_dir():
        return
    from rllog.errors import TransientError

    cursor = CursorStore(run_dir, "parquet")
    cursor.acquire()
    try:
        saved = cursor.load()
        repair(directory, saved.status if saved.state == SinkState.CLOSED else None)
    except TransientError as exc:  # a full disk: the store stays readable as it is; the next replay finishes it
        console.print(f"[yellow]parquet: the store's unfinished merge is left for later ({exc})[/yellow]")
    finally:
        cursor.release()


def cmd_replay(args) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from rllog.agent import serve
    from rllog.errors import SinkBusy
    from rllog.registry import resolve
    from rllog.rundir import report

    args.run_dir = resolve_run(args.run_dir)
    names = [resolve(n).name for n in args.to.split(",") if n.strip()]
    before = report(args.run_dir, names)
    total = before.records
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), console=console) as progress:
            tasks = {n: progress.add_task(f"replay to {n}", total=total, completed=before[n].delivered) for n in names}
            failed = serve(
                args.run_dir,
                follow=False,
                parent_pid=None,
                only=names,
                on_progress=lambda n, seq: progress.update(tasks[n], completed=min(total, seq)),
            )
        if "parquet" in names:
            _repair_parquet(args.run_dir)
    except SinkBusy as exc:
        if run_status(Path(args.run_dir)) == "running":
            why = "the run is live: its delivery agent delivers it; replay once the run has ended"
        else:
            why = f"another process is already delivering this run ({exc}); wait for it to end and try again"
        notes.print(f"[red]error:[/red] {escape(why)}")
        return EXIT_BUSY
    after = report(args.run_dir, names)
    for n in names:
        r = after[n]
        sent = r.delivered - before[n].delivered
        console.print(
            f"{n}: delivered {sent} new records ({r.delivered}/{total} in all), state {r.state}{': ' + r.error if r.error else ''}"
        )
        if r.dead_letters:
            console.print(f"  {r.dead_letters} dead-lettered records: {r.dead_letter_list[:3]}")
    if after.journal_damage:
        console.print(f"journal: {after.journal_damage.describe()}")
    return 1 if failed else 0


def cmd_demo(args) -> int:
    from rllog.demo import run_demo

    result = run_demo(steps=args.steps, run_dir=args.run_dir, report_to=args.report_to, simulated=args.simulate)
    console.print(f"\n[bold]delivery:[/bold]\n{result.report}\n")
    show_run(result.run_dir, result.summary)
    console.print(f"wrote {result.plot}")
    return 0 if result.report.ok else 1


def main(argv: list[str] | None = None) -> int:
    from rllog import __version__

    parser = argparse.ArgumentParser(prog="rllog", description="rllog: one logging call site, every tracker, nothing lost.")
    parser.add_argument("--version", action="version", version=f"rllog {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("runs", help="list the runs under a folder (default $RLLOG_DIR or rllog_runs)")
    p.add_argument("dir", nargs="?", default=None)
    p.set_defaults(func=cmd_runs)
    p = sub.add_parser("show", help="summarise a run: steps, per metric last/min/max, tables, delivery state")
    p.add_argument("run_dir", nargs="?", default=None, help="a run directory, or a folder of runs (default: the latest run)")
    p.set_defaults(func=cmd_show)
    p = sub.add_parser("plot", help="plot the metrics of one run, or of several overlaid, to a PNG")
    p.add_argument("runs", nargs="*", help="run directories or folders of runs (default: the latest run)")
    p.add_argument("-o", "--output", default=None, help="PNG path (default RUN_DIR/metrics.png)")
    p.add_argument("--metrics", default=None, help="comma-separated metric names (default: the crucial ones present)")
    p.add_argument("--smooth", type=float, default=0.0, help="exponential smoothing weight in [0, 1), as TensorBoard's")
    p.set_defaults(func=cmd_plot)
    p = sub.add_parser("replay", help="deliver a run's journal to backends from each one's cursor")
    p.add_argument("run_dir", nargs="?", default=None, help="a run directory, or a folder of runs (default: the latest run)")
    p.add_argument("--to", required=True, help="backend names, comma-separated")
    p.set_defaults(func=cmd_replay)
    sub.add_parser("backends", help="list built-in and entry-point backends, installed or not").set_defaults(func=cmd_backends)
    p = sub.add_parser("demo", help="a tiny GRPO run (TRL, CPU) written to the embedded default, then show and plot")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--report-to", default=None)
    p.add_argument("--simulate", action="store_true", help="simulated metrics instead of a real tiny TRL run")
    p.set_defaults(func=cmd_demo)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (CliError, RllogError, FileNotFoundError, NotADirectoryError) as exc:
        notes.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
