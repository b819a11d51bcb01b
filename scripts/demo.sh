#!/usr/bin/env bash
# The main job: a real tiny GRPO training (TRL, CPU, a tiny local model) logging through rllog to the
# embedded default (parquet), then the run summary (`rllog show`) and a PNG plot.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/rllog demo --run-dir "${RLLOG_DEMO_DIR:-rllog_runs/demo-$(date +%Y%m%d-%H%M%S)}" "$@"
