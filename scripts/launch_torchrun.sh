#!/usr/bin/env bash
# Launch the main job under torchrun: N processes = TP × CP × PP × DP (first argument, default 1), flags passed on to
# slime_corr.main on top of the same preset as scripts/run.sh (decoupled_seq_is_rs; a later
# --rollout-correction-preset replaces it). One process (rank 0) drives the rollout and prints; on CPU the ranks talk
# over gloo. The flags are checked once before torchrun starts, so a bad flag gives one message, not one per rank.
#   bash scripts/launch_torchrun.sh 2 --num-rollout 3                                    # DP=2
#   bash scripts/launch_torchrun.sh 4 --tensor-model-parallel-size 2 --rollout-correction-preset decoupled_seq_is_rs
# PY selects the interpreter (default: .venv/bin/python, made by scripts/run.sh or scripts/setup_env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
NPROC=1
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then
  NPROC=$1
  shift
fi
PRESET=(--rollout-correction-preset decoupled_seq_is_rs)
WORLD_SIZE=$NPROC RANK=0 "$PY" -m slime_corr.main "${PRESET[@]}" "$@" --self-check > /dev/null
MAIN_PY=$PY bash scripts/setup_sglang.sh --for-run "$@" >/dev/null  # the real SGLang server, when the run needs it
exec "$PY" -m slime_corr.trainer.torchrun --standalone --nproc-per-node "$NPROC" -m slime_corr.main "${PRESET[@]}" "$@"
