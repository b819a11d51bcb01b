"""docs/architecture.md against the tree: its file table names every module, and every path and dotted name it
gives exists. Pure text (no import of rllog), so it costs milliseconds.

How the table names a file (the rules a row may use):

- a full path, ``rllog/x.py`` or ``rllog/pkg/mod.py``; a folder, ``rllog/pkg/`` (which names its ``__init__.py``);
- a bare module name, ``mod.py``, after a full path or a folder in the same row: the module of that path's folder
  (``rllog/run/null.py``, ``base.py`` names ``rllog/run/base.py``; ``rllog/delivery/`` | ``follower.py`` names
  ``rllog/delivery/follower.py``);
- a placeholder, ``rllog_backends/<name>.py``, names nothing by itself and is not checked for existence.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("rllog", "rllog_backends")
TABLE_HEADING = "## Which file owns what"
# Dotted names in backticks that are not modules: the entry-point group third-party backends register under.
NOT_MODULES = {"rllog.backends"}

BACKTICKED = re.compile(r"`([^`]+)`")
FENCED = re.compile(r"^```.*?^```", re.S | re.M)  # code blocks: their backticks would pair with the prose's
# A path into one of the packages anywhere in the page (the flow picture's paths are not in backticks).
PATH = re.compile(r"(?<![\w/.-])((?:rllog|rllog_backends)/[\w./<>]*)")
BARE_MODULE = re.compile(r"^[\w]+\.py$")
DOTTED = re.compile(r"^rllog(?:\.\w+)+$")


def _table_rows(text: str) -> list[str]:
    after = text.split(TABLE_HEADING, 1)[1]
    table = after.split("\n## ", 1)[0]
    return [line for line in table.splitlines() if line.startswith("| `")]


def _row_names(row: str) -> tuple[set[str], set[str]]:
    """The files and folders one row names (paths relative to the root; folders end with '/')."""
    files: set[str] = set()
    folders: set[str] = set()
    folder: str | None = None
    for token in BACKTICKED.findall(row):
        if token.startswith(tuple(p + "/" for p in PACKAGES)):
            if token.endswith("/"):
                folder = token
                folders.add(token)
            else:
                folder = str(PurePosixPath(token).parent) + "/"
                if "<" not in token:
                    files.add(token)
        elif folder is not None and BARE_MODULE.match(token):
            files.add(folder + token)
    return files, folders


def _named_in_table(text: str) -> tuple[set[str], set[str]]:
    files: set[str] = set()
    folders: set[str] = set()
    for row in _table_rows(text):
        row_files, row_folders = _row_names(row)
        files |= row_files
        folders |= row_folders
    return files, folders


def _modules() -> set[str]:
    return {str(p.relative_to(ROOT)) for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def test_the_file_table_names_every_module():
    files, folders = _named_in_table(DOC.read_text())
    covered = files | {folder + "__init__.py" for folder in folders}
    unnamed = sorted(_modules() - covered)
    assert not unnamed, f"docs/architecture.md's file table does not name: {unnamed}"


def test_every_path_the_page_names_exists():
    text = DOC.read_text()
    table_files, table_folders = _named_in_table(text)
    anywhere = {p.rstrip(".") for p in PATH.findall(text) if "<" not in p}
    missing = sorted(p for p in table_files | table_folders | anywhere if not (ROOT / p).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_every_dotted_name_the_page_gives_is_defined():
    """``rllog.records.RUN_STATUSES``: a module ``rllog/records.py`` that defines ``RUN_STATUSES``."""
    wrong = []
    for token in set(BACKTICKED.findall(FENCED.sub("", DOC.read_text()))):
        if not DOTTED.match(token) or token in NOT_MODULES:
            continue
        parts = token.split(".")
        # the longest prefix that is a module (a file, or a package's __init__.py)
        for cut in range(len(parts), 0, -1):
            base = ROOT.joinpath(*parts[:cut])
            module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
            if module.is_file():
                break
        else:
            wrong.append(f"{token}: no module")
            continue
        rest = parts[cut:]
        if rest and not re.search(rf"\b{re.escape(rest[0])}\b", module.read_text()):
            wrong.append(f"{token}: {module.relative_to(ROOT)} has no {rest[0]}")
    assert not wrong, f"docs/architecture.md gives names the code lacks: {wrong}"


def test_the_table_reading_rules():
    """The rules above, on rows of the page's own shape (a failing rule would hide modules or invent paths)."""
    files, folders = _row_names("| `rllog/run/null.py`, `base.py` | `NullRun` and `RunBase` |")
    assert (files, folders) == ({"rllog/run/null.py", "rllog/run/base.py"}, set())
    files, folders = _row_names("| `rllog/delivery/` | `follower.py`: `Follower`; `cursor.py`: `CursorStore` |")
    assert (files, folders) == ({"rllog/delivery/follower.py", "rllog/delivery/cursor.py"}, {"rllog/delivery/"})
    files, _ = _row_names("| `rllog_backends/<name>.py` | one tracker each: `wandb.py` |")
    assert files == {"rllog_backends/wandb.py"}
