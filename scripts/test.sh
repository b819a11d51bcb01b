#!/usr/bin/env bash
# The whole test suite, offline (every tracker writes under pytest's tmp dirs; non-loopback connects fail):
# ruff (lint and format check) and mypy first, then pytest. Arguments go to pytest (then lint is skipped:
# `bash scripts/test.sh tests/test_journal.py` runs just that file).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "$#" -eq 0 ]; then
  echo "lint and types: ruff check, ruff format --check, mypy" >&2
  bash scripts/lint.sh
fi
# -n 3: three pytest workers (pytest-xdist). Most of a test's time is spent waiting on a delivery agent, a tracker or
# a fault, so three workers on this 2-core machine took the suite from 13:23 to 9:08 (`-n 0` after the command: one
# process). --durations: the slowest tests, listed at the end (the suite must stay well under CI's 15 minutes).
exec .venv/bin/python -m pytest -q -n 3 --durations=25 "$@"
