#!/usr/bin/env bash
# Install slime_corr into .venv and run the main job. Extra arguments are passed to it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/setup_env.sh)
exec "$PY" -m slime_corr.main "$@"
