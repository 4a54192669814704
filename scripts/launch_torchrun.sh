#!/usr/bin/env bash
# Launch the main job under torchrun: N processes = TP × CP × PP × DP (first argument, default 1), flags passed on to
# slime_corr.main. One process (rank 0) drives the rollout and prints; on CPU the ranks talk over gloo.
#   bash scripts/launch_torchrun.sh 4 --tensor-model-parallel-size 2 --rollout-correction-preset decoupled_seq_is_rs
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
NPROC=1
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then
  NPROC=$1
  shift
fi
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" -m slime_corr.main "$@"
