"""Console backend: a live Rich panel in a terminal, plain lines otherwise.

In a terminal (``console.is_terminal``) the sink keeps one panel up to date (``rich.live.Live``):

* the run's project / name and status;
* the step, and with ``total_steps`` a progress bar, the percentage, the elapsed time and the ETA
  (from the records' own timestamps: the rate between the first and the latest logged step);
* the crucial metrics of :mod:`rllog.catalog` that the run logs (plus ``metrics=[...]``), each with
  its last value coloured by :func:`rllog.catalog.health` (green: in the healthy range, red:
  outside it or NaN/inf, plain: no documented range) and what is good for it;
* the latest ``max_alerts`` health alerts (yellow: warning, red: error), and a count line per table.

When the output is not a terminal (a log file, CI, a pipe) it prints plain lines instead: one per
logged step whose step is a multiple of ``every``, with every value as ``key=value`` (crucial metrics
first; an unhealthy value is followed by ``!``), one per alert (``WARNING step 40 [entropy_collapse]
entropy=0.05: ...``), and one per table.

Where it writes: the ``console`` argument (a ``rich.console.Console``, e.g. a recording one in tests);
otherwise the file descriptor in ``$RLLOG_CONSOLE_FD`` (the delivery agent sets it to a duplicate of the
trainer's stdout, so the panel shows in the trainer's terminal although the agent is another process);
otherwise ``sys.stdout``. Options are JSON-able, so they can come from ``backend_options``::

    rllog.init(report_to="console,wandb", backend_options={"console": {"total_steps": 500, "every": 10}})

The panel draws over the lines below the cursor: other output written to the same terminal at the same
time (the trainer's own progress bar, prints) interleaves with it; use ``live=False`` for plain lines.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections import deque
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from rllog.catalog import crucial_keys, format_range, health, lookup
from rllog.records import AlertRecord, MetricsRecord, RunInfo, TableRecord
from rllog.sink import CONSOLE_FD, Capabilities
from rllog.sink_errors import is_disk_full, map_errors

HEALTH_STYLE = {"ok": "green", "unhealthy": "bold red", None: ""}
LEVEL_STYLE = {"error": "bold red", "warning": "yellow"}


def _mapped_errors() -> AbstractContextManager[None]:
    """A full disk under the output (stdout sent to a file) is retried; any other output error (the
    terminal is gone: a broken pipe, a closed descriptor) is permanent: retrying cannot bring it back."""
    return map_errors("console", permanent=(OSError,))


def fmt_value(value: float) -> str:
    """A metric value as the console shows it (4 significant digits; ``nan``, ``inf`` as such)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e9:
        return str(int(value))
    return f"{value:.4g}"


def fmt_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "-"
    seconds = round(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class ConsoleSink:
    """Shows the run in the terminal: a live panel, or plain lines when not a terminal.

    Args:
        total_steps: the step the run ends at, for the progress bar and ETA (unknown: step and rate only).
        every: in plain-line mode, print the metrics of steps that are a multiple of ``every``.
        max_alerts: how many of the latest alerts the panel shows.
        max_metrics: how many metrics the panel shows at most.
        metrics: metric names to show besides the catalog's crucial ones present in the run.
        live: force the live panel (True) or plain lines (False); default: live when the output is a terminal.
        refresh_per_second: the most panel redraws per second (each flush and alert redraws at once).
        console: a ``rich.console.Console`` to write to (default: ``$RLLOG_CONSOLE_FD``, else stdout).
    """

    capabilities = Capabilities(tables=True, config=False, alerts=True)

    def __init__(
        self,
        total_steps: int | None = None,
        every: int = 1,
        max_alerts: int = 5,
        max_metrics: int = 14,
        metrics: Sequence[str] | None = None,
        live: bool | None = None,
        refresh_per_second: float = 4.0,
        console: Any = None,
    ):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.total_steps = int(total_steps) if total_steps else None
        self.every = int(every)
        self.max_metrics = int(max_metrics)
        self.extra_metrics = list(metrics or [])
        self.refresh_interval = 1.0 / refresh_per_second if refresh_per_second > 0 else 0.0
        self.console = console
        self._live_option = live
        self._live: Any = None
        self._file: Any = None
        self.run_info: RunInfo | None = None
        self.values: dict[str, tuple[int, float]] = {}  # key -> (step, last value)
        self.alerts: deque[AlertRecord] = deque(maxlen=max(1, int(max_alerts)))
        self.alert_count = 0
        self.tables: dict[str, list[int]] = {}  # name -> [times logged, rows]
        self.status = "running"
        self._first: tuple[int, float] | None = None  # (step, time) of the first metrics record
        self._last: tuple[int, float] | None = None
        self._dirty = False
        self._last_draw = 0.0

    # -- output -----------------------------------------------------------------------------------
    def _make_console(self):
        from rich.console import Console

        fd = CONSOLE_FD.get()
        if fd is not None:
            try:
                self._file = os.fdopen(fd, "w", buffering=1, closefd=False)
                return Console(file=self._file)
            except OSError:  # the descriptor is closed: the trainer's stdout is gone
                self._file = None
        return Console(file=sys.stdout)

    @property
    def is_live(self) -> bool:
        return self._live is not None

    # -- MetricSink -------------------------------------------------------------------------------
    def open(self, run_info: RunInfo) -> None:
        self.run_info = run_info
        if self.console is None:
            self.console = self._make_console()
        live = self.console.is_terminal if self._live_option is None else bool(self._live_option)
        if live:
            from rich.live import Live

            self._live = Live(
                self._render(),
                console=self.console,
                auto_refresh=False,
                transient=False,
                redirect_stdout=False,
                redirect_stderr=False,
            )
            self._live.start(refresh=True)
            self._last_draw = time.monotonic()
        else:
            self._print(f"rllog: run {run_info.project}/{run_info.name} ({run_info.run_id}) in {run_info.run_dir}")

    def write_metrics(self, records: Sequence[MetricsRecord]) -> None:
        with _mapped_errors():
            for r in records:
                if self._first is None:
                    self._first = (r.step, r.time)
                if self._last is None or r.step >= self._last[0]:
                    self._last = (r.step, r.time)
                for key, value in r.values.items():
                    self.values[key] = (r.step, value)
                if self._live is None and r.step % self.every == 0:
                    self._print_metrics(r)
            self._redraw()

    def write_table(self, record: TableRecord) -> None:
        entry = self.tables.setdefault(record.name, [0, 0])
        entry[0] += 1
        entry[1] += record.table.num_rows
        with _mapped_errors():
            if self._live is None:
                if record.step % self.every == 0:
                    self._print(f"step {record.step} table {record.name}: {record.table.num_rows} rows")
            else:
                self._redraw()

    def write_alert(self, record: AlertRecord) -> None:
        self.alerts.append(record)
        self.alert_count += 1
        with _mapped_errors():
            if self._live is None:
                self._print_alert(record)
            else:
                self._redraw(force=True)

    def flush(self) -> None:
        with _mapped_errors():
            if self._live is not None and self._dirty:
                self._redraw(force=True)
            elif self._file is not None:
                self._file.flush()

    def close(self, status: str) -> None:
        self.status = status
        with _mapped_errors():
            if self._live is not None:
                self._live.update(self._render(), refresh=False)
                self._live.stop()  # draws the final panel
                self._live = None
            else:
                step = self._last[0] if self._last else "-"
                self._print(
                    f"rllog: run {self.run_info.name if self.run_info else ''} {status} at step {step} ({self.alert_count} alert{'' if self.alert_count == 1 else 's'})"
                )
            if self._file is not None:
                try:
                    self._file.flush()
                except OSError as exc:  # the trainer's terminal may be gone; a full disk under its log is worth a retry
                    if is_disk_full(exc):
                        raise

    # -- plain lines ------------------------------------------------------------------------------
    def _print(self, text) -> None:
        self.console.print(text, highlight=False, soft_wrap=True)

    def _progress_text(self, step: int) -> str:
        if not self.total_steps:
            return f"step {step}"
        pct = 100.0 * step / self.total_steps
        return f"step {step}/{self.total_steps} ({pct:.0f}%, eta {fmt_duration(self.eta())})"

    def _print_metrics(self, record: MetricsRecord) -> None:
        from rich.text import Text

        line = Text(self._progress_text(record.step))
        keys = list(record.values)
        crucial = crucial_keys(keys)
        for key in crucial + sorted(set(keys) - set(crucial)):
            value = record.values[key]
            state = health(key, value)
            line.append(f" {key}=")
            line.append(fmt_value(value) + ("!" if state == "unhealthy" else ""), style=HEALTH_STYLE[state])
        self._print(line)

    def _print_alert(self, a: AlertRecord) -> None:
        from rich.text import Text

        self._print(
            Text(
                f"{a.level.upper()} step {a.step} [{a.rule}] {a.metric}={fmt_value(a.value)}: {a.message}",
                style=LEVEL_STYLE.get(a.level, "yellow"),
            )
        )

    # -- the live panel ---------------------------------------------------------------------------
    def rate(self) -> float | None:
        """Steps per second between the first and the latest logged step (records' own times)."""
        if self._first is None or self._last is None:
            return None
        steps, seconds = self._last[0] - self._first[0], self._last[1] - self._first[1]
        return steps / seconds if steps > 0 and seconds > 0 else None

    def eta(self) -> float | None:
        rate = self.rate()
        if not self.total_steps or self._last is None or rate is None:
            return None
        return max(0.0, self.total_steps - self._last[0]) / rate

    def shown_metrics(self) -> list[str]:
        keys = crucial_keys(self.values)
        keys += [k for k in self.extra_metrics if k in self.values and k not in keys]
        if not keys:
            keys = sorted(self.values)
        return keys[: self.max_metrics]

    def _redraw(self, force: bool = False) -> None:
        if self._live is None:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < self.refresh_interval:
            self._dirty = True
            return
        self._live.update(self._render(), refresh=True)
        self._last_draw, self._dirty = now, False

    def _render(self):
        from rich import box
        from rich.console import Group
        from rich.panel import Panel
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        parts: list[Any] = []
        step = self._last[0] if self._last else None
        elapsed = self._last[1] - self._first[1] if self._first and self._last else None
        rate = self.rate()
        if self.total_steps:
            done = min(step or 0, self.total_steps)
            bar = Table.grid(padding=(0, 1))
            bar.add_column(width=12)
            bar.add_column(ratio=1)
            bar.add_column(no_wrap=True)
            bar.add_row(
                Text(f"step {step if step is not None else '-'}/{self.total_steps}"),
                ProgressBar(total=self.total_steps, completed=done),
                Text(f"{100.0 * done / self.total_steps:.0f}%  elapsed {fmt_duration(elapsed)}  eta {fmt_duration(self.eta())}"),
            )
            parts.append(bar)
        else:
            rate_text = f"  {rate:.3g} steps/s" if rate else ""
            parts.append(Text(f"step {step if step is not None else '-'}{rate_text}  elapsed {fmt_duration(elapsed)}"))
        shown = self.shown_metrics()
        if shown:
            table = Table(box=box.SIMPLE_HEAD, expand=False, pad_edge=False)
            table.add_column("metric", no_wrap=True)
            table.add_column("value", justify="right", no_wrap=True)
            table.add_column("good", style="dim")
            table.add_column("step", justify="right", style="dim")
            for key in shown:
                at, value = self.values[key]
                state = health(key, value)
                info = lookup(key)
                good = ""
                if info is not None:
                    good = " ".join(filter(None, [info.good or "", f"({format_range(info.healthy)})" if info.healthy else ""]))
                table.add_row(key, Text(fmt_value(value), style=HEALTH_STYLE[state]), good, str(at))
            parts.append(table)
        else:
            parts.append(Text("waiting for metrics...", style="dim"))
        if self.alerts:
            parts.append(Text(f"alerts ({self.alert_count}):", style="bold"))
            for a in self.alerts:
                parts.append(
                    Text(
                        f"step {a.step} {a.level.upper()} [{a.rule}] {a.metric}={fmt_value(a.value)}: {a.message}",
                        style=LEVEL_STYLE.get(a.level, "yellow"),
                    )
                )
        for name, (n, rows) in sorted(self.tables.items()):
            parts.append(Text(f"table {name}: logged {n} times, {rows} rows", style="dim"))
        run_info = self.run_info
        title = f"rllog: {run_info.project}/{run_info.name}" if run_info else "rllog"
        status_style = {"running": "cyan", "finished": "green", "failed": "red", "killed": "red"}.get(self.status, "")
        return Panel(
            Group(*parts), title=title, subtitle=Text(self.status, style=status_style), title_align="left", border_style="blue"
        )
