#!/usr/bin/env bash
# Lint, format check and type check, read-only (configured in pyproject.toml: [tool.ruff], [tool.mypy]). Runs all three
# and fails if any fails. To apply ruff's fixes: .venv/bin/ruff check --fix . && .venv/bin/ruff format .
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
status=0
.venv/bin/ruff check . || status=1
.venv/bin/ruff format --check . || status=1
.venv/bin/mypy || status=1
exit $status
