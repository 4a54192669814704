#!/usr/bin/env bash
# One command on a GPU machine (H100/H200, CUDA; no internet beyond pip's wheels): install, then run what only a GPU
# can check, writing ONE report file.
#
#   bash scripts/gpu_check.sh                       # everything, report in runs/gpu_check/report-<time>.md
#   bash scripts/gpu_check.sh --report FILE         # the report there
#   bash scripts/gpu_check.sh --only tests,bench    # some steps: env,install,tests,sglang,bench,e2e
#   bash scripts/gpu_check.sh --dry-run             # print the plan (every command), run nothing
#   bash scripts/gpu_check.sh --cpu                 # the CPU-runnable parts with this machine's python (CI)
#
# Steps (each PASS / FAIL / SKIP in the report, with the tail of its output; the exit status is 1 if any FAILed):
#   env      nvidia-smi, python, torch, CUDA, NCCL
#   install  a venv ($GPU_CHECK_VENV, default .venv-gpu) with torch==$TORCH_VERSION from pip (the CUDA wheel on
#            Linux x86_64) and slime_corr[dev,sglang]
#   tests    the device-parametrized subset on CUDA (`pytest -m device --device cuda`): the correction and the losses
#            on the GPU against the CPU, DP=2, CP=2 and TP=2 (vocab-parallel log-probs) over NCCL with one GPU
#            per rank (with one GPU: two processes on it, gloo on CUDA tensors, since NCCL refuses two ranks on one
#            GPU), plus the meta-device checks
#   sglang   the real SGLang server on the GPU with a small model behind the client and the trainer:
#            `python -m slime_corr.main --rollout-engine sglang --num-rollout 2` and `pytest -m sglang`
#            (each SKIPped with a line saying so when this checkout has no such flag / marker)
#   bench    bench/vs_verl.py on CUDA, eager and compiled (--compile), 1 thread
#   e2e      bench/e2e.py (with --rollout-engine sglang when the trainer has it)
# Environment: TORCH_VERSION (2.13.0), GPU_CHECK_VENV, GPU_CHECK_PYTEST_K (a pytest -k expression),
# GPU_CHECK_PYTEST_ARGS (extra pytest args, split at spaces),
# GPU_CHECK_BENCH_ARGS (extra vs_verl.py args), GPU_CHECK_E2E_ARGS (extra e2e.py args).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

MODE=gpu
ONLY="env,install,tests,sglang,bench,e2e"
REPORT=""
DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --cpu) MODE=cpu ;;
    --only) ONLY="$2"; shift ;;
    --report) REPORT="$2"; shift ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
for step in ${ONLY//,/ }; do
  case "$step" in env|install|tests|sglang|bench|e2e) ;;
    *) echo "gpu_check.sh: --only: unknown step '$step' (env,install,tests,sglang,bench,e2e)" >&2; exit 2 ;;
  esac
done
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
VENV=${GPU_CHECK_VENV:-.venv-gpu}
if [ "$MODE" = cpu ]; then
  DEVICE=cpu
  PY=${PYTHON:-python3}
  [ -x "$ROOT/.venv/bin/python" ] && [ -z "${PYTHON:-}" ] && PY="$ROOT/.venv/bin/python"
else
  DEVICE=cuda
  PY="$VENV/bin/python"
fi
REPORT=${REPORT:-runs/gpu_check/report-$(date -u +%Y%m%dT%H%M%SZ).md}
mkdir -p "$(dirname "$REPORT")"
FAILED=0

wants() { case ",$ONLY," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
note() { echo "$*" | tee -a "$REPORT"; }

# run NAME CMD...: one step; its status and the last 60 lines of its output go to the report
run() {
  local name=$1; shift
  if [ "$DRY" = 1 ]; then
    note "- [plan] $name: $*"
    return 0
  fi
  local log; log=$(mktemp)
  local t0=$SECONDS
  echo ">>> $name: $*" >&2
  "$@" >"$log" 2>&1
  local rc=$?
  local status=PASS
  [ $rc -ne 0 ] && status=FAIL && FAILED=1
  note ""
  note "### $name: $status (exit $rc, $((SECONDS - t0)) s)"
  note '```'
  note "\$ $*"
  grep -v '^USDT:' "$log" | tail -n 60 | tee -a "$REPORT" >/dev/null
  note '```'
  rm -f "$log"
  return $rc
}

skip() { note ""; note "### $1: SKIP ($2)"; }

note "# slime_corr GPU check ($MODE mode$([ "$DRY" = 1 ] && echo ', dry run'))"
note ""
note "$(date -u '+%Y-%m-%d %H:%M:%S UTC'), git $(git rev-parse --short HEAD 2>/dev/null || echo '?'), steps: $ONLY, device: $DEVICE"

# ---------------------------------------------------------------------------------------------- env
if wants env; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    run "env: nvidia-smi" nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  elif [ "$MODE" = gpu ]; then
    [ "$DRY" = 1 ] && note "- [plan] env: nvidia-smi (not found on this machine)" || {
      note ""; note "### env: FAIL (no nvidia-smi: not a GPU machine; use --cpu)"; FAILED=1; }
  else
    skip "env: nvidia-smi" "CPU mode"
  fi
fi

# ---------------------------------------------------------------------------------------------- install
install_gpu_venv() (  # a subshell: set -e stays inside
  set -e
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # torch first, from pip's default index: on Linux x86_64 that wheel is the CUDA build (its CUDA libraries come
  # as nvidia-* wheels, no system CUDA toolkit needed)
  "$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION"
  "$VENV/bin/python" -m pip install -q -e ".[dev,sglang]"
  "$VENV/bin/python" -c "import torch; assert torch.cuda.is_available(), 'torch sees no GPU'; \
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), 'nccl', torch.cuda.nccl.version())"
)
if wants install; then
  if [ "$MODE" = gpu ]; then
    run "install: $VENV (torch==$TORCH_VERSION CUDA wheel, slime_corr[dev,sglang])" install_gpu_venv
  else
    run "install: none in CPU mode, using $PY" "$PY" -c "import torch, slime_corr; print(torch.__version__, slime_corr.__file__)"
  fi
fi

# ---------------------------------------------------------------------------------------------- tests
if wants tests; then
  pytest_k=()
  [ -n "${GPU_CHECK_PYTEST_K:-}" ] && pytest_k=(-k "$GPU_CHECK_PYTEST_K")
  # shellcheck disable=SC2086
  run "tests: device subset on $DEVICE" "$PY" -m pytest -q -m device --device "$DEVICE" -p no:cacheprovider -p no:warnings \
    tests/correction/test_device.py tests/mcore/test_mcore_device.py "${pytest_k[@]}" ${GPU_CHECK_PYTEST_ARGS:-}
  # shellcheck disable=SC2086
  run "tests: meta-device allocation checks" "$PY" -m pytest -q -p no:cacheprovider -p no:warnings -m "not device" \
    tests/correction/test_device.py tests/mcore/test_mcore_device.py "${pytest_k[@]}" ${GPU_CHECK_PYTEST_ARGS:-}
fi

# ---------------------------------------------------------------------------------------------- sglang
if wants sglang; then
  if [ "$MODE" = cpu ]; then
    skip "sglang: the real server" "CPU mode: the real SGLang server needs the GPU"
  elif [ "$DRY" = 0 ] && ! "$PY" -m slime_corr.main --help 2>/dev/null | grep -q -- "--rollout-engine"; then
    skip "sglang: trainer" "this checkout's trainer has no --rollout-engine flag yet (the real-SGLang issue adds it)"
  else
    run "sglang: trainer with the real SGLang engine" "$PY" -m slime_corr.main --rollout-engine sglang --num-rollout 2
  fi
  if [ "$MODE" = cpu ]; then
    :
  elif [ "$DRY" = 0 ] && ! "$PY" -m pytest --markers 2>/dev/null | grep -q "@pytest.mark.sglang"; then
    skip "sglang: pytest -m sglang" "no test in this checkout is marked sglang"
  else
    run "sglang: pytest -m sglang" "$PY" -m pytest -q -m sglang -p no:cacheprovider
  fi
fi

# ---------------------------------------------------------------------------------------------- benches
if wants bench; then
  # vs_verl fetches verl's wheel from PyPI into bench/.cache (git-ignored) on first use
  # shellcheck disable=SC2086
  if [ "$MODE" = cpu ]; then
    run "bench: vs_verl.py on cpu (small)" "$PY" bench/vs_verl.py --threads 1 --repeats 3 --sizes 8x256 \
      --rows metrics,ppo ${GPU_CHECK_BENCH_ARGS:-}
  else
    run "bench: vs_verl.py on cuda, eager and compiled" "$PY" bench/vs_verl.py --device cuda --compile \
      --threads 1 ${GPU_CHECK_BENCH_ARGS:-}
  fi
fi
if wants e2e; then
  if [ "$MODE" = cpu ]; then
    skip "e2e: bench/e2e.py" "CPU mode (minutes on CPU: run it by hand)"
  else
    e2e_flags=()
    if [ "$DRY" = 1 ] || "$PY" -m slime_corr.main --help 2>/dev/null | grep -q -- "--rollout-engine"; then
      e2e_flags=(-- --rollout-engine sglang)
    fi
    # shellcheck disable=SC2086
    run "e2e: bench/e2e.py" "$PY" bench/e2e.py --repeats 3 ${GPU_CHECK_E2E_ARGS:-} "${e2e_flags[@]}"
  fi
fi

note ""
if [ "$DRY" = 1 ]; then
  note "dry run: nothing was run"
elif [ "$FAILED" = 0 ]; then
  note "RESULT: every step passed or was skipped (report: $REPORT)"
else
  note "RESULT: some step FAILED (report: $REPORT)"
fi
exit "$FAILED"
