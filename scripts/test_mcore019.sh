#!/usr/bin/env bash
# The Megatron tests (tests/mcore) and the Triton kernels' (tests/kernels) on megatron-core 0.19.x, whose wheel ships Megatron-LM's own training loop
# (megatron.training): that release (and the triton its schedules import) is installed without dependencies into
# .mcore019/ (git-ignored; seconds, once) and laid over .venv's packages with PYTHONPATH, so both runs share one
# environment but for megatron-core. PY=/path/to/python: that interpreter's packages instead of .venv's (which
# `EXTRAS=dev bash scripts/setup_env.sh` installs). scripts/test.sh runs it beside the main run at the lowest priority;
# on its own: `bash scripts/test_mcore019.sh` (arguments go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
MCORE019_VERSION=0.19.2
OVERLAY=.mcore019
PY=${PY:-.venv/bin/python}
WORKERS=${PYTEST_WORKERS:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # scripts/test.sh says why
if ! PYTHONPATH=$OVERLAY "$PY" -c "import importlib.metadata as m, sys
sys.exit(m.version('megatron-core') != '$MCORE019_VERSION')" 2>/dev/null; then
  rm -rf "$OVERLAY"
  source scripts/pip_quiet.sh
  # 0.19.x declares Python >= 3.12 (its wheel runs on 3.11); its dependencies are .venv's
  pip_quiet "$PY" -m pip install -q "${NO_COMPILE[@]}" --target "$OVERLAY" --no-deps --ignore-requires-python \
    "megatron-core==$MCORE019_VERSION" triton
  PYTHONPATH=$OVERLAY "$PY" -c "import megatron.core.models.gpt" >/dev/null 2>&1 || true  # its bytecode, once
fi
echo "== tests/mcore on megatron-core $MCORE019_VERSION ($OVERLAY over .venv)"
PARALLEL=()
[ "$WORKERS" != 0 ] && PARALLEL=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder)
# the four-process layouts run on one megatron-core version: the version-dependent calls (schedules, DDP,
# finalize_model_grads) are the same at two processes
# tests/kernels: the Triton kernels under Triton's interpreter, which needs the triton this overlay brings (.venv has
# none: megatron-core 0.16 would take it up)
PYTHONPATH=$OVERLAY exec "$PY" -m pytest -q -p no:cacheprovider "${PARALLEL[@]}" tests/mcore tests/kernels \
  --ignore tests/mcore/test_mcore_parallel_world4.py \
  --deselect "tests/mcore/test_mcore_gpt.py::test_tiny_gpt_gradients_match_single_rank_under_dp_cp_tp_pp[4]" "$@"
