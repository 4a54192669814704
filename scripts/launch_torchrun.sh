#!/usr/bin/env bash
# Launch the main job under torchrun (one process: the demo model runs at TP = CP = DP = 1).
#   bash scripts/launch_torchrun.sh --use-tis --tis-level geometric --sglang-url http://HOST:30000
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 -m slime_corr.main "$@"
