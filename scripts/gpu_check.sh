#!/usr/bin/env bash
# One command on a GPU machine (H100/H200, CUDA torch already installed, often no network): run what only a GPU can
# check, with a Python that is already there, and write ONE report. Nothing is downloaded, ever.
#
#   bash scripts/gpu_check.sh --python /usr/bin/python3              # that interpreter (no venv is created)
#   bash scripts/gpu_check.sh --python PY --wheels DIR               # first install what PY lacks from DIR's wheels
#   bash scripts/gpu_check.sh --only device,main --report FILE       # some steps; the report there
#   bash scripts/gpu_check.sh --dry-run                              # print the plan (every command), run nothing
#   bash scripts/gpu_check.sh --cpu                                  # the CPU-runnable parts (CI runs a part)
#
# --python PY   the interpreter (default: $PYTHON, else .venv/bin/python, else python3); the project runs from this
#               source tree (PYTHONPATH), so PY needs only the dependencies: torch (CUDA), megatron-core, aiohttp...
# --wheels DIR  install the packages PY lacks from the wheels in DIR (`pip install --no-index --no-deps --target
#               .gpu_check_site`, put first on PYTHONPATH; a package PY already has is never replaced, torch
#               included); verl's wheel there also serves bench/vs_verl.py. Make DIR on a machine with a network:
#               pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#                 -d DIR megatron-core mbridge verl ...
# Steps (each PASS / FAIL / SKIP with its reason in the report, the tail of its output, and a summary at the end;
# the exit status is 1 when a step FAILed, 2 for bad arguments):
#   env       the interpreter, torch, CUDA, NCCL, the GPUs (nvidia-smi) and which dependencies PY has
#   wheels    install the missing packages from --wheels DIR (SKIP without it)
#   device    `pytest -m device --device cuda` (correction and losses, DP=2 / CP=2 / TP=2 over NCCL or gloo on
#             CUDA tensors, the tiny GPT + embedded engine + one optimizer step on the GPU), one file per run
#   meta      the device checks without a GPU (meta device: model building, engine, trainer step, weight sync)
#   failing   the tests that failed on the first GPU run (design/GPU_MEASURED.md, section 3)
#   main      `python -m slime_corr.main --rollout-engine embedded --num-rollout 2 --device cuda`
#   sglang    the same with `--rollout-engine sglang`, and `pytest -m sglang` (SKIP when PY cannot import sglang)
#   megatron  Megatron-LM's own train_step with the loss hook (tests/mcore/test_megatron_lm.py)
#   kernels   the Triton kernels compiled on the GPU against their torch paths (tests/kernels/triton_interpreted.py
#             --device cuda: log-probs + entropy, the kept set, TP=2, the correction's token pass), then
#             bench/logprobs.py --device cuda (ours, ours-triton, Megatron-Core + verl, verl, Liger where installed)
#   bench     bench/vs_verl.py --device cuda, eager and --fused (SKIP without verl's wheel: it is not fetched)
#   compiled  the same with --compile (--rollout-correction-compile beside eager and verl)
#   e2e       bench/e2e.py (the SGLang engine when importable, else the embedded one) on the GPU
# Without a GPU (torch.cuda.is_available() False) every GPU step is a SKIP naming that; --cpu runs the CPU parts.
# Environment: GPU_CHECK_PYTEST_K (a pytest -k expression for device/meta), GPU_CHECK_PYTEST_ARGS,
# GPU_CHECK_BENCH_ARGS (extra vs_verl.py args), GPU_CHECK_COMPILE_ARGS (more for its --compile run), GPU_CHECK_E2E_ARGS (extra e2e.py args), GPU_CHECK_STEP_TIMEOUT
# (seconds per step, default 1800), GPU_CHECK_SITE (where --wheels installs, default .gpu_check_site), GPU_CHECK_TAIL
# (lines of each step's output in the report, default 60).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
STEPS="env,wheels,device,meta,failing,main,sglang,megatron,kernels,bench,compiled,e2e"

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
die() { echo "gpu_check.sh: $*" >&2; exit 2; }

MODE=gpu
ONLY=$STEPS
REPORT=""
DRY=0
PY=""
WHEELS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --cpu) MODE=cpu ;;
    --only|--report|--python|--wheels)
      [ $# -ge 2 ] && [ -n "$2" ] || die "$1 needs a value (see --help)"
      case "$1" in --only) ONLY=$2 ;; --report) REPORT=$2 ;; --python) PY=$2 ;; --wheels) WHEELS=$2 ;; esac
      shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
  shift
done
for step in ${ONLY//,/ }; do
  case ",$STEPS," in *",$step,"*) ;; *) die "--only: unknown step '$step' ($STEPS)" ;; esac
done
if [ -z "$PY" ]; then
  PY=${PYTHON:-python3}
  [ -z "${PYTHON:-}" ] && [ -x "$ROOT/.venv/bin/python" ] && PY="$ROOT/.venv/bin/python"
fi
command -v "$PY" >/dev/null 2>&1 || die "--python $PY: no such interpreter"
[ -z "$WHEELS" ] || [ -d "$WHEELS" ] || die "--wheels $WHEELS: no such directory"
[ -z "$WHEELS" ] || WHEELS=$(cd "$WHEELS" && pwd)

STAMP=$(date -u +%Y%m%dT%H%M%SZ)
REPORT=${REPORT:-runs/gpu_check/report-$STAMP.md}
mkdir -p "$(dirname "$REPORT")"
WORK="$(dirname "$REPORT")/work-$STAMP"
SITE=${GPU_CHECK_SITE:-$ROOT/.gpu_check_site}
STEP_TIMEOUT=${GPU_CHECK_STEP_TIMEOUT:-1800}
# the project from this tree, the wheels' packages after it; nothing may reach a package index or the Hub
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PIP_NO_INDEX=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
: >"$REPORT"
FAILED=0
SUMMARY=()

wants() { case ",$ONLY," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
note() { echo "$*" | tee -a "$REPORT"; }
py_has() { "$PY" -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec(sys.argv[1]) else 1)" "$1" 2>/dev/null; }

# run NAME CMD...: one step; its status and the last GPU_CHECK_TAIL lines of its output go to the report
run() {
  local name=$1; shift
  if [ "$DRY" = 1 ]; then
    note "- [plan] $name: $*"
    SUMMARY+=("| $name | plan | |")
    return 0
  fi
  local log; log=$(mktemp)
  local t0=$SECONDS
  echo ">>> $name: $*" >&2
  if command -v timeout >/dev/null 2>&1 && ! declare -F "$1" >/dev/null; then  # a function runs as it is
    timeout "$STEP_TIMEOUT" "$@" >"$log" 2>&1
  else
    "$@" >"$log" 2>&1
  fi
  local rc=$?
  local status=PASS why="exit 0"
  if [ $rc -ne 0 ]; then
    status=FAIL why="exit $rc"; FAILED=1
    [ $rc -eq 124 ] && why="exit 124: over GPU_CHECK_STEP_TIMEOUT=${STEP_TIMEOUT}s"
  fi
  note ""
  note "### $name: $status ($why, $((SECONDS - t0)) s)"
  note '```'
  note "\$ $*"
  grep -v '^USDT:' "$log" | tail -n "${GPU_CHECK_TAIL:-60}" | tee -a "$REPORT" >/dev/null
  note '```'
  rm -f "$log"
  SUMMARY+=("| $name | $status | $why, $((SECONDS - t0)) s |")
  return $rc
}

skip() {
  if [ "$DRY" = 1 ]; then note "- [plan] $1: SKIP ($2)"; else note ""; note "### $1: SKIP ($2)"; fi
  SUMMARY+=("| $1 | SKIP | $2 |")
}

# needs STEP MODULE...: true when PY can import every module, else a SKIP naming the missing ones
needs() {
  local step=$1 missing=() m; shift
  [ "$DRY" = 1 ] && return 0
  for m in "$@"; do py_has "$m" || missing+=("$m"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  skip "$step" "$PY cannot import ${missing[*]}: pass --wheels DIR holding their wheels"
  return 1
}

note "# slime_corr GPU check ($MODE mode$([ "$DRY" = 1 ] && echo ', dry run'))"
note ""
note "$(date -u '+%Y-%m-%d %H:%M:%S UTC'), git $(git rev-parse --short HEAD 2>/dev/null || echo '?'), python: $PY, \
wheels: ${WHEELS:-none}, steps: $ONLY"

# ---------------------------------------------------------------------------------------------- the device
if [ "$MODE" = cpu ]; then
  DEVICE=cpu NO_GPU=""
elif [ "$DRY" = 1 ]; then
  DEVICE=cuda NO_GPU=""
else
  DEVICE=cuda
  NO_GPU=$("$PY" -c "import torch; print('' if torch.cuda.is_available() else f'no GPU: torch {torch.__version__} \
sees none (torch.cuda.is_available() is False); --cpu runs the CPU parts')" 2>&1 | tail -n 1)
  "$PY" -c "import torch" 2>/dev/null || NO_GPU="no GPU check: $PY cannot import torch"
fi
# gpu_step STEP: true when the step may run on the device, else a SKIP saying why
gpu_step() { [ -z "$NO_GPU" ] && return 0; skip "$1" "$NO_GPU"; return 1; }

# ---------------------------------------------------------------------------------------------- env
ENV_PY='import importlib, importlib.metadata as md, platform, sys
import torch
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {p.name} {p.total_memory // 2**20} MiB")
if torch.cuda.is_available():
    print("nccl", torch.cuda.nccl.version())
for dist in ("megatron-core", "mbridge", "transformers", "safetensors", "aiohttp", "numpy", "pyyaml", "pytest",
             "triton", "sglang", "sglang-router", "verl", "tensorboard"):
    try:
        print(f"  {dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"  {dist} MISSING")'
show_env() { "$PY" -c "$ENV_PY"; }
if wants env; then
  run "env: python, torch, CUDA, packages" show_env
  if command -v nvidia-smi >/dev/null 2>&1; then
    run "env: nvidia-smi" nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  else
    skip "env: nvidia-smi" "not on PATH"
  fi
fi

# ---------------------------------------------------------------------------------------------- wheels
# install_wheels: the wheels of DIR whose distribution PY lacks, with no index and no dependencies
install_wheels() (
  set -e
  missing=()
  for whl in "$WHEELS"/*.whl; do
    [ -e "$whl" ] || continue
    dist=$(basename "$whl" | cut -d- -f1)
    if "$PY" -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$dist" 2>/dev/null; then
      echo "have $dist: $(basename "$whl") not installed"
    else
      missing+=("$whl")
    fi
  done
  [ ${#missing[@]} -eq 0 ] && { echo "nothing missing"; exit 0; }
  mkdir -p "$SITE"
  if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install --no-index --no-deps --no-build-isolation --target "$SITE" "${missing[@]}"
  else  # a wheel is a zip laid out for site-packages
    for whl in "${missing[@]}"; do "$PY" -m zipfile -e "$whl" "$SITE"; done
  fi
  printf 'installed into %s: %s\n' "$SITE" "$(basename -a "${missing[@]}" | tr '\n' ' ')"
)
if wants wheels; then
  if [ -z "$WHEELS" ]; then
    skip "wheels" "no --wheels DIR: nothing to install (nothing is ever downloaded)"
  else
    run "wheels: what $PY lacks, from $WHEELS" install_wheels
  fi
fi

PYTEST=("$PY" -m pytest -q -p no:cacheprovider -p no:warnings)
pytest_k=()
[ -n "${GPU_CHECK_PYTEST_K:-}" ] && pytest_k=(-k "$GPU_CHECK_PYTEST_K")
# shellcheck disable=SC2206
pytest_extra=(${GPU_CHECK_PYTEST_ARGS:-})

# ---------------------------------------------------------------------------------------------- device tests
if wants device && gpu_step "device" && needs "device" pytest; then
  # one file per pytest process: tests/mcore's conftest adapts Megatron to the CPU for the rest of its process
  for f in tests/correction/test_device.py tests/mcore/test_mcore_device.py; do
    run "device: pytest -m device --device $DEVICE $f" "${PYTEST[@]}" -m device --device "$DEVICE" "$f" \
      "${pytest_k[@]}" "${pytest_extra[@]}"
  done
fi
if wants meta && needs "meta" pytest; then
  run "meta: device checks without a GPU" "${PYTEST[@]}" -m "not device" tests/test_device_owner.py \
    tests/rollout/test_engine_device.py tests/mcore/test_device_placement.py tests/mcore/test_mcore_device.py \
    "${pytest_k[@]}" "${pytest_extra[@]}"
fi

# ---------------------------------------------------------------------------------------------- failing before
if wants failing && gpu_step "failing" && needs "failing" pytest; then
  run "failing: torch.compile against eager (tests/correction)" "${PYTEST[@]}" \
    "tests/correction/test_compiled.py::test_compiled_equals_eager[cfg0-dtype0-1e-10]" \
    "tests/correction/test_compiled.py::test_compiled_equals_eager[cfg1-dtype1-2e-05]" \
    "tests/correction/test_packed.py::test_packed_under_torch_compile_matches_eager"
  run "failing: one-rank Megatron steps in the test process (tests/mcore)" "${PYTEST[@]}" \
    "tests/mcore/test_mcore_parallel.py::test_presets_on_one_rank_padded_and_packed_match_the_reference" \
    "tests/mcore/test_token_budget.py::test_token_budget_packed_step_equals_the_padded_step"
fi

# ---------------------------------------------------------------------------------------------- the main job
MAIN=("$PY" -m slime_corr.main --num-rollout 2 --device "$DEVICE")
if wants main && gpu_step "main" && needs "main" megatron.core aiohttp; then
  run "main: the main job, embedded engine, on $DEVICE" "${MAIN[@]}" --rollout-engine embedded \
    --run-dir "$WORK/main-embedded"
fi
if wants sglang; then
  if [ "$MODE" = cpu ]; then
    skip "sglang" "CPU mode: SGLang's CPU server is tested by tests/real_sglang (scripts/test.sh)"
  elif gpu_step "sglang"; then
    if [ "$DRY" = 0 ] && ! py_has sglang; then
      skip "sglang" "$PY cannot import sglang (SGLang's CUDA build; install it, or pass --wheels DIR)"
    else
      run "sglang: the main job, SGLang server, on $DEVICE" "${MAIN[@]}" --rollout-engine sglang \
        --sglang-python "$PY" --run-dir "$WORK/main-sglang"
      # the suite pins itself to the CPU (tests/conftest.py): here the SGLang tests run on the GPU
      run "sglang: pytest -m sglang on $DEVICE" env SLIME_CORR_DEVICE="$DEVICE" "${PYTEST[@]}" -m sglang \
        tests/real_sglang
    fi
  fi
fi
if wants megatron; then
  if [ "$MODE" = cpu ]; then
    skip "megatron" "CPU mode: tests/mcore/test_megatron_lm.py is part of the CPU suite"
  elif gpu_step "megatron" && needs "megatron" pytest megatron.training; then
    run "megatron: Megatron-LM's train_step with the loss hook" "${PYTEST[@]}" tests/mcore/test_megatron_lm.py
  fi
fi

# ---------------------------------------------------------------------------------------------- Triton kernels
# kernels_on_gpu: every case of the interpreter's tests, compiled on CUDA tensors; FAIL unless each says "ok"
kernels_on_gpu() {
  local out="$WORK/kernels.json"
  mkdir -p "$WORK"
  "$PY" -m tests.kernels.triton_interpreted "$out" --device "$DEVICE" || return 1
  "$PY" -c "import json, sys
results = json.load(open(sys.argv[1]))
bad = {k: v for k, v in results.items() if v != 'ok'}
print(len(results) - len(bad), 'cases ok;', len(bad), 'not:', json.dumps(bad, indent=1))
sys.exit(1 if bad else 0)" "$out"
}
if wants kernels; then
  if [ "$MODE" = cpu ]; then
    skip "kernels" "CPU mode: the kernels run under Triton's interpreter in scripts/test_mcore019.sh (tests/kernels)"
  elif gpu_step "kernels" && needs "kernels" triton; then
    run "kernels: Triton kernels compiled on $DEVICE against the torch paths" kernels_on_gpu
    variants=ours,ours-triton,megatron,verl
    { [ "$DRY" = 1 ] || py_has liger_kernel; } && variants+=,liger
    run "kernels: bench/logprobs.py on $DEVICE" "$PY" bench/logprobs.py --device "$DEVICE" --variants "$variants" \
      --repeats 3 --iters 5
  fi
fi

# ---------------------------------------------------------------------------------------------- benches
VERL_VERSION=$(sed -n 's/^VERL_VERSION = "\(.*\)"$/\1/p' bench/vs_verl.py)
VERL_CACHE=bench/.cache/verl
# verl_here: verl's wheel (or its unpacked tree) in bench/.cache/verl, copied there from --wheels when it is there
verl_here() {
  [ -d "$VERL_CACHE/verl-$VERL_VERSION/verl" ] && return 0
  compgen -G "$VERL_CACHE/verl-$VERL_VERSION-*.whl" >/dev/null && return 0
  if [ -n "$WHEELS" ] && compgen -G "$WHEELS/verl-$VERL_VERSION-*.whl" >/dev/null; then
    mkdir -p "$VERL_CACHE" && cp "$WHEELS"/verl-"$VERL_VERSION"-*.whl "$VERL_CACHE"/ && return 0
  fi
  return 1
}
# shellcheck disable=SC2206
bench_extra=(${GPU_CHECK_BENCH_ARGS:-})
for step in bench compiled; do
  wants "$step" || continue
  if [ "$DRY" = 0 ] && ! verl_here; then
    skip "$step" "verl $VERL_VERSION's wheel is in neither $VERL_CACHE nor --wheels DIR (it is not fetched)"
  elif [ "$MODE" = cpu ]; then
    [ "$step" = bench ] && run "bench: vs_verl.py on cpu (small)" "$PY" bench/vs_verl.py --threads 1 --repeats 3 \
      --sizes 8x256 --rows metrics,ppo "${bench_extra[@]}"
    [ "$step" = compiled ] && skip "compiled" "CPU mode (torch.compile takes minutes on a CPU: run it by hand)"
  elif gpu_step "$step"; then
    if [ "$step" = bench ]; then
      run "bench: vs_verl.py on cuda, eager and --fused" "$PY" bench/vs_verl.py --device cuda --fused --threads 1 \
        "${bench_extra[@]}"
    else
      # shellcheck disable=SC2206
      compile_extra=(${GPU_CHECK_COMPILE_ARGS:-})
      run "compiled: vs_verl.py on cuda, eager and --compile" "$PY" bench/vs_verl.py --device cuda --compile \
        --threads 1 "${bench_extra[@]}" "${compile_extra[@]}"
    fi
  fi
done
if wants e2e; then
  if [ "$MODE" = cpu ]; then
    skip "e2e" "CPU mode (minutes on a CPU: run bench/e2e.py by hand)"
  elif gpu_step "e2e" && needs "e2e" megatron.core aiohttp; then
    engine=embedded
    { [ "$DRY" = 1 ] || py_has sglang; } && engine=sglang
    # shellcheck disable=SC2206
    run "e2e: bench/e2e.py, $engine engine, on $DEVICE" "$PY" bench/e2e.py --repeats 3 --rollout-engine "$engine" \
      ${GPU_CHECK_E2E_ARGS:-} -- --device "$DEVICE"
  fi
fi

# ---------------------------------------------------------------------------------------------- the summary
note ""
note "## Summary"
note ""
note "| step | status | why |"
note "|---|---|---|"
for line in "${SUMMARY[@]}"; do note "$line"; done
note ""
if [ "$DRY" = 1 ]; then
  note "dry run: nothing was run"
elif [ "$FAILED" = 0 ]; then
  note "RESULT: every step passed or was skipped (report: $REPORT)"
else
  note "RESULT: some step FAILED (report: $REPORT)"
fi
exit "$FAILED"
