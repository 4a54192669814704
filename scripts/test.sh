#!/usr/bin/env bash
# Install slime_corr with its dev extra into .venv and the real SGLang server into .venv-sglang, and run ruff + the
# test suite (benchmarks marked slow are skipped; tests/real_sglang runs against real SGLang servers), then the
# Megatron tests (tests/mcore) again on megatron-core 0.19.x, whose wheel ships Megatron-LM's own training loop
# (megatron.training), in a second environment kept in .venv-mcore019/ (git-ignored; created on the first run,
# reused after). Arguments go to the first pytest run and skip the second one (set MCORE019=1
# to run it anyway).
set -euo pipefail
cd "$(dirname "$0")/.."
MCORE019_VERSION=0.19.2
PY=$(EXTRAS=dev bash scripts/setup_env.sh)
# The real SGLang server for tests/real_sglang (CPU build, .venv-sglang/). If it cannot be installed the run goes on
# and those tests say why: they skip on a developer machine and fail under CI (CI=true).
bash scripts/setup_sglang.sh >/dev/null || echo "== scripts/setup_sglang.sh failed: tests/real_sglang cannot run" >&2
"$PY" -m ruff check .
"$PY" -m pytest -q --durations=40 "$@"
if [ $# -eq 0 ] || [ -n "${MCORE019:-}" ]; then
  echo "== tests/mcore on megatron-core $MCORE019_VERSION (.venv-mcore019)"
  PY019=$(VENV=.venv-mcore019 MEGATRON_CORE=$MCORE019_VERSION EXTRAS=dev bash scripts/setup_env.sh)
  "$PY019" -m pytest -q tests/mcore
fi
