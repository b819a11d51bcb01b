"""Every ``rllog.<name>`` the README and docs/ call or name as a class is exported by ``rllog`` and documented the
Google way, with an Example block (torchtune's metric_logging is the model). Text and one ``import rllog``: cheap.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import rllog

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# rllog.init(...), rllog.Run: a call of the top-level package or one of its classes (rllog.delivery is a module).
PUBLIC_USE = re.compile(r"\brllog\.(?:([a-z_]\w*)\(|([A-Z]\w*))")


def _names_the_pages_use() -> set[str]:
    names: set[str] = set()
    for page in PAGES:
        for call, cls in PUBLIC_USE.findall(page.read_text()):
            names.add(call or cls)
    return names


def test_the_pages_use_the_public_api():
    """The scan finds the names a reader meets first (an empty scan would pass the tests below vacuously)."""
    assert {"init", "log", "prepare", "read_metrics", "Run"} <= _names_the_pages_use()


def test_every_name_the_pages_use_is_exported():
    missing = sorted(n for n in _names_the_pages_use() if n not in rllog.__all__ or not hasattr(rllog, n))
    assert not missing, f"README/docs use rllog.{missing} but rllog.__all__ does not export them"


def test_every_name_the_pages_use_has_args_and_an_example():
    lacking = []
    for name in sorted(_names_the_pages_use()):
        obj = getattr(rllog, name)
        doc = inspect.getdoc(obj) or ""
        takes_arguments = bool(inspect.signature(obj).parameters)
        if "Example:" not in doc or ">>> " not in doc.split("Example:", 1)[1]:
            lacking.append(f"{name}: no Example block")
        if takes_arguments and not inspect.isclass(obj) and "Args:" not in doc:
            lacking.append(f"{name}: no Args section")
    assert not lacking, f"public names without a Google-style docstring: {lacking}"
