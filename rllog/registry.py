"""Backend names -> sink classes, and ``report_to`` parsing.

The only place that knows which backends exist. Built-in backends live in ``rllog_backends`` and are
imported lazily (only when selected); third-party backends register an entry point in the group
``rllog.backends``::

    [project.entry-points."rllog.backends"]
    neptune = "my_pkg.sink:NeptuneSink"
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from rllog.errors import BackendNotInstalled, InvalidSink, UnknownBackend
from rllog.sink import MetricSink, sink_problem

ENTRY_POINT_GROUP = "rllog.backends"
BUILT_IN = "built-in"
DEFAULT = "parquet"


@dataclass(frozen=True)
class Backend:
    """A selectable backend: where its sink class lives and what it needs installed."""

    name: str
    target: str  # "module:Class"
    requires: str | None = None  # top-level module of the tracker package
    extra: str | None = None  # pip extra that installs it
    source: str = BUILT_IN

    @property
    def installed(self) -> bool:
        return self.requires is None or importlib.util.find_spec(self.requires) is not None

    def problem(self) -> str | None:
        """Why this backend cannot be used (None when it can): its module does not import, or its sink class does
        not implement the sink protocol."""
        try:
            cls = self.load()
        except BackendNotInstalled as exc:
            return str(exc)
        except Exception as exc:  # a plugin's module that fails to import, whatever it raises
            return f"{self.target} does not import: {type(exc).__name__}: {exc}"
        return sink_problem(cls)

    def load(self) -> type:
        if not self.installed:
            raise BackendNotInstalled(
                f"backend {self.name!r} needs the {self.requires!r} package: pip install 'rllog[{self.extra}]'"
                if self.extra
                else f"backend {self.name!r} needs the {self.requires!r} package"
            )
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)

    def prepare(self) -> None:
        """What a standby agent does while a trainer is built: import the sink class, its tracker and the
        modules its ``open`` and first writes import (the class's optional ``prepare_imports``; one this
        tracker version lacks is skipped), then call the class's optional ``prepare()`` classmethod (which
        may warm a cache but starts no tracker run)."""
        cls = self.load()
        for module in [self.requires, *getattr(cls, "prepare_imports", ())]:
            if module:
                try:
                    importlib.import_module(module)
                except ImportError:
                    pass
        warm = getattr(cls, "prepare", None)
        if callable(warm):
            warm()


BUILTIN: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("parquet", "rllog_backends.parquet:ParquetSink"),
        Backend("console", "rllog_backends.console:ConsoleSink"),
        Backend("wandb", "rllog_backends.wandb:WandbSink", "wandb", "wandb"),
        Backend("trackio", "rllog_backends.trackio:TrackioSink", "trackio", "trackio"),
        Backend("tensorboard", "rllog_backends.tensorboard:TensorBoardSink", "tensorboard", "tensorboard"),
        Backend("mlflow", "rllog_backends.mlflow:MlflowSink", "mlflow", "mlflow"),
        Backend("comet_ml", "rllog_backends.comet:CometSink", "comet_ml", "comet"),
        Backend("swanlab", "rllog_backends.swanlab:SwanLabSink", "swanlab", "swanlab"),
        Backend("clearml", "rllog_backends.clearml:ClearMLSink", "clearml", "clearml"),
        Backend("dvclive", "rllog_backends.dvclive:DVCLiveSink", "dvclive", "dvclive"),
    )
}
ALIASES = {"comet": "comet_ml", "tb": "tensorboard"}
# Selected by "all" only when named: it draws on the terminal.
NOT_IN_ALL = {"console"}


_plugins: tuple[tuple[str, ...], list[Backend]] | None = None  # (sys.path, entry-point backends) of the last look


def backends(refresh: bool = False) -> dict[str, Backend]:
    """Every known backend, built-in first, then entry points (an entry point may not shadow a built-in).

    The entry points are looked up once per ``sys.path``: the lookup reads every installed package's metadata
    (~20 ms with a trainer's dependencies), and ``train()`` resolves each backend twice: 0.28 s with six backends.
    ``refresh`` looks again, as :func:`resolve` does for a name it does not know (a plugin installed since).
    """
    global _plugins
    path = tuple(sys.path)
    if _plugins is None or _plugins[0] != path or refresh:
        if refresh:
            _forget_listings()
        found = [
            Backend(ep.name, ep.value, source=f"entry point ({ep.dist.name if ep.dist else '?'})")
            for ep in entry_points(group=ENTRY_POINT_GROUP)
        ]
        _plugins = (path, found)
    known = dict(BUILTIN)
    for backend in _plugins[1]:
        known.setdefault(backend.name, backend)
    return known


def resolve(name: str) -> Backend:
    """The backend called ``name`` (aliases allowed).

    Raises:
        UnknownBackend: with the available names and a close match, if any.
    """
    key = ALIASES.get(name.strip().lower(), name.strip().lower())
    if key in BUILTIN:  # no entry point may shadow it: no need to read every installed package's metadata
        return BUILTIN[key]
    known = backends()
    if key not in known:
        known = backends(refresh=True)
    if key in known:
        return known[key]
    _raise_if_out_of_descriptors()
    close = difflib.get_close_matches(key, list(known) + list(ALIASES), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise UnknownBackend(f"unknown backend {name!r}{hint} Available: {', '.join(sorted(known))}")


def _forget_listings() -> None:
    """Make the next entry-point lookup list every ``sys.path`` directory again: ``importlib.metadata`` keeps each
    listing until the directory's mtime changes, one that failed too (an empty one). Python 3.11's
    ``importlib.invalidate_caches`` does not reach that cache, so its finder is asked directly."""
    importlib.invalidate_caches()
    importlib.metadata.MetadataPathFinder().invalidate_caches()


def _raise_if_out_of_descriptors() -> None:
    """``importlib.metadata`` skips a ``sys.path`` entry it cannot list (it suppresses the error), so in a process
    with no descriptor left an installed plugin looks unknown. Raise what the process ran out of instead: a
    delivery agent waits that out and opens the sink, where "unknown backend" would have failed it for good."""
    from rllog.sink_errors import RESOURCE_ERRNOS  # here: import rllog stays clear of sqlite3 and email

    try:
        os.close(os.open(os.curdir, os.O_RDONLY))
    except OSError as exc:
        if exc.errno in RESOURCE_ERRNOS:
            raise OSError(exc.errno, f"the installed backends could not be listed: {exc.strerror}") from exc


def parse_report_to(report_to: Any) -> list[Any]:
    """Turn ``report_to`` into a list of backend names and sink objects, like transformers does.

    ``None`` -> the default (``["parquet"]``); ``"none"`` -> ``[]``; ``"all"`` -> every installed
    backend; ``"a,b"`` or ``["a", "b"]`` -> those names; a sink object -> itself.
    """
    if report_to is None:
        return [DEFAULT]
    items: Iterable[Any] = report_to if isinstance(report_to, (list, tuple)) else [report_to]
    out: list[Any] = []
    for item in items:
        if isinstance(item, str):
            for part in (p.strip() for p in item.split(",")):
                if not part or part.lower() == "none":
                    continue
                if part.lower() == "all":
                    out.extend(n for n, b in backends().items() if b.installed and n not in NOT_IN_ALL)
                else:
                    backend = resolve(part)
                    if not backend.installed:
                        backend.load()  # raises BackendNotInstalled naming the extra
                    if backend.source != BUILT_IN:  # built-ins are held to the protocol by the contract suite
                        problem = backend.problem()
                        if problem is not None:
                            raise InvalidSink(f"backend {backend.name!r} ({backend.source}): {problem}")
                    out.append(backend.name)
        elif isinstance(item, MetricSink) and sink_problem(item) is None:
            out.append(item)
        else:
            raise InvalidSink(f"report_to entries must be backend names or MetricSink objects: {sink_problem(item)}")
    seen: set = set()
    unique = []
    for item in out:
        key = item if isinstance(item, str) else id(item)
        if key not in seen:
            seen.add(key)
            unique.append(item)
    return unique


def create(name: str, options: dict[str, Any] | None = None) -> MetricSink:
    """Build the sink for backend ``name`` with JSON-able keyword ``options``."""
    sink = resolve(name).load()(**(options or {}))
    problem = sink_problem(sink)
    if problem is not None:
        raise InvalidSink(f"backend {name!r}: {problem}")
    return sink
