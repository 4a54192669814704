#!/usr/bin/env bash
# Install the real SGLang server (sglang 0.5.23, from PyPI only) for CPU into its own environment, .venv-sglang/
# (git-ignored; skipped when up to date), and print that environment's python. The trainer starts the servers with
# it (`--rollout-engine sglang`); the CPU stand-ins it needs beyond PyPI live in slime_corr/engines/sglang_cpu/.
#   bash scripts/setup_sglang.sh            # VENV=... to put it elsewhere
# Why by hand: sglang pins torch==2.14.1, a CUDA build on PyPI. torch 2.13.0 (the CPU wheel) goes first, sglang
# itself with --no-deps, then the pure-Python packages its server imports (measured in SGLANG_ON_CPU.md). Its GPU-only
# dependencies (flashinfer, sgl-kernel, cuda-python, nvidia-*, flash-attn, torchvision, ...) are left out.
# On a GPU machine use your own sglang install instead: `--sglang-python /path/to/python`.
#   bash scripts/setup_sglang.sh --for-run FLAGS...   # only when a main-job run with FLAGS launches SGLang servers
#       itself and MAIN_PY (the job's python) has no sglang of its own (scripts/run.sh, launch_torchrun.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/pip_quiet.sh  # pip_quiet: pip without the notes that ask nothing of the user
if [ "${1:-}" = "--for-run" ]; then
  shift
  case " $* " in
    *" --rollout-engine embedded "*|*" --rollout-engine=embedded "*|*" --sglang-url"*|*" --sglang-python"*) exit 0 ;;
  esac
  if [ -n "${MAIN_PY:-}" ] && "$MAIN_PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('sglang') is None)" \
      2>/dev/null; then
    exit 0
  fi
fi
VENV=${VENV:-.venv-sglang}
PY=${PYTHON:-python3}
SGLANG_VERSION=0.5.23
STAMP="$VENV/.slime_corr_sglang"  # written last: slime_corr/engines/sglang_server.py (INSTALL_STAMP) reads it
PACKAGES=(
  aiohttp anthropic blobfile build distro easydict einops fastapi gguf interegular IPython "llguidance>=1.7.6,<2"
  "mistral_common>=1.11.5" msgspec ninja numpy openai==2.8.0 openai-harmony==0.0.4 orjson packaging
  partial_json_parser pillow "prometheus-client>=0.20" psutil pybase64 pydantic "python-dateutil<3" python-multipart
  "pyzmq>=25.1.2" regex requests scipy sentencepiece==0.2.1 setproctitle tiktoken tokenizers==0.23.2 tqdm
  transformers==5.19.0 "uvicorn>=0.51" uvloop watchfiles xxhash zstandard triton==3.9.0 dill apache-tvm-ffi==0.1.11
  compressed-tensors==0.18.0 xgrammar==0.2.7 soundfile==0.13.1 accelerate safetensors
)
stamp_id=$(printf '%s\n' "sglang==$SGLANG_VERSION" "${PACKAGES[@]}" | sha256sum | cut -d' ' -f1)
up_to_date() { [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$stamp_id" ]; }
if up_to_date; then
  echo "$VENV/bin/python"
  exit 0
fi
# One install at a time: this one holds $VENV/.install.lock (flock) to its end. Another (scripts/run.sh while
# scripts/test.sh installs) waits for it, and so does a job or test that looks for the server meanwhile
# (slime_corr/engines/sglang_server.py: wait_for_install).
mkdir -p "$VENV"
exec 9>"$VENV/.install.lock"
if ! flock -n 9; then
  echo "scripts/setup_sglang.sh: waiting for another install into $VENV to end" >&2
  flock 9
fi
if up_to_date; then
  echo "$VENV/bin/python"
  exit 0
fi
LABEL="setup $VENV (the SGLang server)"
[ -x "$VENV/bin/python" ] || install_step "$LABEL" "a new virtual environment" "$PY" -m venv "$VENV"
install_step "$LABEL" "pip's newest release (~2 MB)" \
  pip_quiet "$VENV/bin/python" -m pip install -q "${NO_COMPILE[@]}" --upgrade pip >&2 || true
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  install_step "$LABEL" "torch 2.13.0 (its CPU wheel: ~190 MB, ~750 MB installed)" \
    pip_quiet "$VENV/bin/python" -m pip install -q "${NO_COMPILE[@]}" "torch==2.13.0" >&2
fi
install_step "$LABEL" "sglang $SGLANG_VERSION (~220 MB installed)" \
  pip_quiet "$VENV/bin/python" -m pip install -q "${NO_COMPILE[@]}" --no-deps "sglang==$SGLANG_VERSION" >&2
install_step "$LABEL" "the server's dependencies (transformers, triton, xgrammar, ...: ~1.8 GB installed)" \
  pip_quiet "$VENV/bin/python" -m pip install -q "${NO_COMPILE[@]}" "torch==2.13.0" "${PACKAGES[@]}" >&2
# Installed without bytecode (NO_COMPILE, scripts/pip_quiet.sh): compile what a server's processes import, once, here
# (with the CPU stand-ins, as slime_corr/engines/sglang_server.py starts it), instead of in each server that starts
if [ ${#NO_COMPILE[@]} -gt 0 ]; then
  SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=slime_corr/engines/sglang_cpu "$VENV/bin/python" -c "import sglang.launch_server
import sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler, sglang.srt.managers.detokenizer_manager
import sglang.srt.model_executor.model_runner, sglang.srt.models.registry  # the registry imports every model" \
    >/dev/null 2>&1 || true
fi
echo "$stamp_id" > "$STAMP"
echo "$VENV/bin/python"
