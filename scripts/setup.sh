#!/usr/bin/env bash
# Creates and fills .venv (idempotent): rllog in editable mode with every tracker, TRL and the test tools,
# torch pinned through constraints.txt (unpinned, pip pulls a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.rllog-setup
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "setting up .venv (first time: about 2-3 minutes, 2 GB) ..." >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first, pinned, so nothing later can pull another build
.venv/bin/python -m pip install -q -c constraints.txt "torch==2.13.0"
.venv/bin/python -m pip install -q -c constraints.txt -e ".[dev]" --config-settings editable_mode=compat
echo "$want" > "$stamp"
