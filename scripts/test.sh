#!/usr/bin/env bash
# The whole test suite, offline (every tracker writes under pytest's tmp dirs; non-loopback connects fail).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
