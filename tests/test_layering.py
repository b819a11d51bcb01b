"""Which part of rllog may import which, read from the source with ``ast`` (the rules: docs/architecture.md,
"Layers").

- The trainer side (``rllog/__init__.py``, ``rllog/run/``, ``rllog/validate/``, ``rllog/distributed.py``, the journal
  writer, ``rllog/integrations/``) imports nothing of the delivery side (``rllog.delivery``, ``rllog.agent``) nor any
  backend (``rllog_backends``), at any level, except ``rllog/run/delivery_link.py``: the one module that starts the
  agent or in-process followers and reads how far they got.
- A backend (``rllog_backends/``) imports of rllog only the sink protocol and what every sink shares:
  :data:`BACKEND_MAY_IMPORT`.
- Those shared modules import, at module level, nothing of the trainer side, the delivery side or a backend, so a
  backend (or the agent) importing them loads none of it.

Imports under ``if TYPE_CHECKING:`` are not imports at run time and are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DELIVERY_SIDE = ("rllog.delivery", "rllog.agent")
BACKENDS = ("rllog_backends",)
TRAINER_SIDE = ("rllog/__init__.py", "rllog/run", "rllog/validate", "rllog/distributed.py", "rllog/integrations")
JOURNAL_WRITER = ("rllog/journal.py", "rllog/journal/__init__.py", "rllog/journal/writer.py")  # whichever exists
THE_LINK = "rllog/run/delivery_link.py"
BACKEND_MAY_IMPORT = (
    "rllog.sink",
    "rllog.records",
    "rllog.errors",
    "rllog.rundir",
    "rllog.files",  # replacing small files whole, the journal's disk reserve (parquet keeps clear of it)
    "rllog.settings",
    "rllog.sink_errors",  # mapping a tracker's exceptions to retries
    "rllog.catalog",  # what a metric means (the console sink shows it)
)
SHARED = tuple(name.replace(".", "/") + ".py" for name in BACKEND_MAY_IMPORT)
TRAINER_MODULES = ("rllog.run", "rllog.validate", "rllog.integrations")

# Known breaks in files this change does not own, each to be fixed where it is (strict: flip once it is).
KNOWN = {}


def _imports(path: Path, module_level_only: bool = False) -> list[tuple[int, str]]:
    """``(line, module)`` of every import of ``path`` (relative ones resolved), outside ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for orelse in child.orelse:
                    visit(orelse, top)
                continue
            if isinstance(child, ast.Import) and (top or not module_level_only):
                found.extend((child.lineno, alias.name) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and (top or not module_level_only):
                base = child.module or ""
                if child.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - child.level + 1] + ([base] if base else []))
                found.extend((child.lineno, f"{base}.{alias.name}") for alias in child.names)
                found.append((child.lineno, base))
            # a class body runs at import, a function body when called
            visit(child, top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, True)
    return found


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _files(*places: str) -> list[str]:
    paths: list[str] = []
    for place in places:
        target = ROOT / place
        paths += [str(p.relative_to(ROOT)) for p in sorted(target.rglob("*.py"))] if target.is_dir() else []
        paths += [place] if target.is_file() else []
    return paths


def _params(paths: list[str]) -> list:
    return [pytest.param(p, marks=pytest.mark.xfail(strict=True, reason=KNOWN[p])) if p in KNOWN else p for p in paths]


TRAINER_FILES = [p for p in _files(*TRAINER_SIDE, *JOURNAL_WRITER) if p != THE_LINK]


@pytest.mark.parametrize("path", _params(TRAINER_FILES))
def test_the_trainer_side_imports_no_delivery_and_no_backend(path):
    bad = [f"line {line}: {module}" for line, module in _imports(ROOT / path) if _under(module, DELIVERY_SIDE + BACKENDS)]
    assert bad == [], f"{path} reaches past rllog/run/delivery_link.py"


@pytest.mark.parametrize("path", _params(_files("rllog_backends")))
def test_a_backend_imports_only_the_sink_protocol_and_the_shared_modules(path):
    bad = [
        f"line {line}: {module}"
        for line, module in _imports(ROOT / path)
        if _under(module, ("rllog",)) and module != "rllog" and not _under(module, BACKEND_MAY_IMPORT)
    ]
    assert bad == [], f"{path} imports more of rllog than BACKEND_MAY_IMPORT"


@pytest.mark.parametrize("path", _params([p for p in SHARED if (ROOT / p).is_file()]))
def test_the_shared_modules_load_no_trainer_delivery_or_backend_code(path):
    bad = [
        f"line {line}: {module}"
        for line, module in _imports(ROOT / path, module_level_only=True)
        if _under(module, DELIVERY_SIDE + BACKENDS + TRAINER_MODULES)
    ]
    assert bad == [], f"importing {path} would load the modules above it"


def test_the_rule_sees_a_breach():
    """The reader finds imports at every level, relative ones, and skips ``TYPE_CHECKING`` blocks only."""
    sample = ROOT / "rllog" / "run" / "_layering_sample.py"
    sample.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from rllog.journal import Scanner\n"
        "def f():\n    from rllog import agent\n"
        "class C:\n    from ..delivery import Follower\n"
        "import rllog_backends.parquet\n"
    )
    try:
        everywhere = {module for _, module in _imports(sample)}
        at_import = {module for _, module in _imports(sample, module_level_only=True)}
    finally:
        sample.unlink()
    assert {"rllog.agent", "rllog.delivery.Follower", "rllog_backends.parquet"} <= everywhere
    assert {"rllog.delivery.Follower", "rllog_backends.parquet"} <= at_import and "rllog.agent" not in at_import
    assert not any(m.startswith("rllog.journal") for m in everywhere)
