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
# --durations: the slowest tests, listed at the end (the suite must stay well under CI's 15 minutes)
exec .venv/bin/python -m pytest -q --durations=25 "$@"
