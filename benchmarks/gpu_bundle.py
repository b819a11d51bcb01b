"""Pack what ``benchmarks/gpu.py`` needs beyond a CUDA machine's own Python, for a machine that cannot reach a registry.

A lent GPU machine has torch, transformers, pyarrow and the like in its image but not TRL, datasets or the trackers,
and nothing can be installed there from the network. This script, run here, where pip reaches a registry:

1. walks the dependencies of TRL, datasets and the five trackers as installed in this ``.venv`` (same versions as the
   test suite; extras such as ``everett[ini]`` followed), leaving out torch and every name in ``--present``;
2. downloads those wheels for the GPU machine's Python (``--python``, default 3.12) and installs them into a folder;
3. drops what only a tracker's web UI uses (MLflow's and trackio's JavaScript, tests) and packs the folder with xz
   (~35 MB, under a device call's 64 MiB).

On the GPU machine: ``mkdir -p /tmp/site && tar -xJf bundle.tar.xz -C /tmp/site && PYTHONPATH=/tmp/site:$PWD python3
benchmarks/gpu.py``. docs/benchmarks.md, section 9, says how the figures there were taken this way.

Example::

    .venv/bin/python benchmarks/gpu_bundle.py --present "$(cat image-packages.txt)" --out .devcarry/site.tar.xz
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.requirements import Requirement

ROOTS = ["trl", "datasets", "wandb", "mlflow", "trackio", "comet-ml"]
NEVER = {"torch"}  # the machine's own CUDA build is the one to measure
UI_ONLY = ["mlflow/server/js", "trackio/frontend"]  # served web pages: a benchmark never opens them
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any"]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: list[str], python: str, present: set[str]) -> dict[str, str]:
    """``{name: version}`` of every installed distribution the roots need, minus ``present`` and :data:`NEVER`."""
    markers = {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux"}
    markers |= {"platform_system": "Linux", "platform_machine": "x86_64"}
    found: dict[str, str] = {}
    stack: list[tuple[str, frozenset[str]]] = [(root, frozenset()) for root in roots]
    visited: set[tuple[str, frozenset[str]]] = set()
    while stack:
        name, extras = stack.pop()
        key = (canonical(name), extras)
        if key in visited or key[0] in NEVER:
            continue
        visited.add(key)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            print(f"  not installed here, left out: {name}", file=sys.stderr)
            continue
        found[key[0]] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            wanted = ["", *sorted(extras)]
            if req.marker and not any(req.marker.evaluate(markers | {"extra": e}) for e in wanted):
                continue
            stack.append((req.name, frozenset(req.extras)))
    return {n: v for n, v in found.items() if n not in present}


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    parser.add_argument("--present", default="", help="comma- or space-separated names the GPU machine already has")
    parser.add_argument("--python", default="3.12", help="the GPU machine's Python (major.minor)")
    parser.add_argument("--out", required=True, help="the .tar.xz to write")
    args = parser.parse_args()
    present = {canonical(n) for n in re.split(r"[,\s]+", args.present) if n}
    needed = closure(ROOTS, args.python, present)
    print(f"{len(needed)} distributions: {' '.join(sorted(needed))}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="rllog-gpu-bundle-") as tmp:
        wheels, site = Path(tmp) / "wheels", Path(tmp) / "site"
        target = ["--only-binary=:all:", "--python-version", args.python, "--implementation", "cp"]
        target += [x for p in PLATFORMS for x in ("--platform", p)]
        pip = [sys.executable, "-m", "pip"]
        pins = [f"{n}=={v}" for n, v in sorted(needed.items())]
        subprocess.run([*pip, "download", "-q", "--no-deps", *target, "-d", str(wheels), *pins], check=True)
        subprocess.run(
            [*pip, "install", "-q", "--no-deps", "--no-compile", *target, "--target", str(site), *map(str, wheels.iterdir())],
            check=True,
        )
        for part in UI_ONLY:
            shutil.rmtree(site / part, ignore_errors=True)
        for tests in list(site.glob("*/tests")):
            shutil.rmtree(tests, ignore_errors=True)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["tar", "-cJf", str(out.resolve()), "-C", str(site), "."], check=True)
    print(f"{out}: {out.stat().st_size / 1e6:.1f} MB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
