#!/usr/bin/env bash
# Install slime_corr with its dev extra into .venv and run the test suite (benchmarks marked slow are skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(EXTRAS=dev bash scripts/setup_env.sh)
"$PY" -m ruff check .
exec "$PY" -m pytest -q "$@"
