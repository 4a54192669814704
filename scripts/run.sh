#!/usr/bin/env bash
# Install slime_corr into .venv and run the main job (an end-to-end RL run on CPU with the embedded engine).
# Arguments are passed to `python -m slime_corr.main`; with none, a 3-step run of the decoupled_seq_is_rs preset.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/setup_env.sh)
if [ $# -eq 0 ]; then
  set -- --rollout-correction-preset decoupled_seq_is_rs --num-steps 3
fi
exec "$PY" -m slime_corr.main "$@"
