"""Every ``python`` and ``bash`` block of README.md, docs/*.md and docs/backends/*.md runs as pasted.

A page's blocks run in order in one fresh directory, as a reader pastes them: python blocks in one interpreter
(a later block uses what an earlier one defined), bash blocks with the ``rllog`` command on PATH. A block that
must not run (it installs from the network, or takes minutes) has ``<!-- not run by tests/test_docs.py: REASON -->``
on the line before it. Blocks in other languages (toml, json, sql) and untagged ones (file listings, output) are
data, not code.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "backends").glob("*.md"))]
RUN = ("python", "bash")
NOT_RUN = re.compile(r"^<!-- not run by tests/test_docs\.py: (?P<reason>\S.*\S) -->$")
FENCE = re.compile(r"^```(?P<lang>[\w-]*)\s*$")
PAGE_SECONDS_MAX = 300  # a page that hangs fails here rather than at CI's limit; the whole file takes well under 90 s

# Python blocks run in one ``__main__`` module, as a script a reader pasted them into would; each block is also
# written to a file named as that module's ``__file__``, so a block that starts ``spawn`` workers (docs/workers.md)
# works: the worker imports the parent's main module from its file.
RUNNER = r"""
import json, os, subprocess, sys, traceback, types
main = types.ModuleType("__main__")
sys.modules["__main__"] = main
namespace = main.__dict__
for block in json.loads(sys.argv[1]):
    where = f"{block['page']}:{block['line']}"
    if block["lang"] == "python":
        main.__file__ = os.path.abspath(f"block_{block['line']}.py")
        with open(main.__file__, "w") as script:
            script.write(block["code"])
        try:
            exec(compile(block["code"], where, "exec"), namespace)
        except BaseException:
            print(f"FAILED {where}", file=sys.stderr)
            traceback.print_exc()
            sys.exit(1)
    elif subprocess.run(["bash", "-euo", "pipefail", "-c", block["code"]]).returncode:
        print(f"FAILED {where}", file=sys.stderr)
        sys.exit(1)
"""


def blocks(page: Path) -> list[dict]:
    """The page's fenced blocks: language, first line, code, and the reason it is not run (None: it runs)."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        marker = NOT_RUN.match(lines[i - 1]) if i else None
        found.append(
            {
                "page": str(page.relative_to(ROOT)),
                "line": i + 1,
                "lang": fence["lang"],
                "code": "\n".join(lines[i + 1 : end]) + "\n",
                "not_run": marker["reason"] if marker else None,
            }
        )
        i = end + 1
    return found


def test_every_block_that_does_not_run_says_why():
    """A skip marker belongs to a python or bash block; a marker anywhere else is a mistake (it would hide nothing)."""
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.startswith("<!-- not run by tests/test_docs.py"):
                assert NOT_RUN.match(line), (
                    f"{page.name}:{i + 1}: give the reason: <!-- not run by tests/test_docs.py: REASON -->"
                )
                assert i + 1 < len(lines) and (fence := FENCE.match(lines[i + 1])) and fence["lang"] in RUN, (
                    f"{page.name}:{i + 1}: the marker must be on the line before a python or bash block"
                )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_page_runs_as_pasted(page, tmp_path):
    runnable = [b for b in blocks(page) if b["lang"] in RUN and b["not_run"] is None]
    if not runnable:
        pytest.skip("no python or bash block to run")
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # the `rllog` command
    env["MPLBACKEND"] = "Agg"
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps(runnable)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=PAGE_SECONDS_MAX,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
