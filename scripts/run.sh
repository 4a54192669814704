#!/usr/bin/env bash
# Install slime_corr into .venv (skipped when it is up to date) and run the main job: GRPO on the toy task with the
# tiny model on CPU, the decoupled_seq_is_rs preset, reward rising within about a minute on 2 cores.
# Flags given are applied on top of that preset (a later --rollout-correction-preset replaces it):
#   bash scripts/run.sh --num-rollout 4 --async-rollout
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/setup_env.sh)
exec "$PY" -m slime_corr.main --rollout-correction-preset decoupled_seq_is_rs "$@"
