"""Rollout correction inside Megatron-LM's own training loop: a pretrain_gpt.py-style RL script.

    torchrun --nproc-per-node 8 examples/megatron_lm/pretrain_rollout_correction.py \
        --tensor-model-parallel-size 2 --context-parallel-size 2 --calculate-per-token-loss \
        --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 4096 \
        --max-position-embeddings 4096 --micro-batch-size 2 --global-batch-size 64 \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model Qwen/Qwen2.5-1.5B --load CKPT --bf16 \
        --lr 1e-6 --train-iters 200 --eval-iters 0 --dataloader-type external \
        --sglang-url http://127.0.0.1:30000 --prompt-file prompts.txt --n-samples-per-prompt 8 \
        --rollout-temperature 1.0 --rollout-max-response-len 1024 --num-steps-per-rollout 1 \
        --rollout-correction-preset decoupled_seq_is_rs

What slime_corr adds to a pretrain_gpt.py (each piece marked `# slime_corr` below):
1. its flags, through `extra_args_provider` (`add_rollout_correction_args`); `config_from_args` validates them at
   start-up, together with Megatron-LM's own RL flags (its IS correction and ours would correct twice);
2. the loss: `RolloutCorrectionLoss`, whose `loss_func` returns Megatron's per-token triple (hence
   `--calculate-per-token-loss`, checked) and reports Megatron's `{key: [numerator, denominator]}` dict;
3. the data: the rollout side (`slime_corr.rollout`: SGLang client, GRPO samples, micro-batches) produces one
   rollout of `--num-steps-per-rollout` optimizer steps at a time; `RolloutStepIterator` is the data iterator
   pretrain() gets (`--dataloader-type external`);
4. `forward_step` reads it with `hook.next_micro_batch(data_iterator, model)`: at a rollout's first step it runs
   the forward-only pass for lp_old (decoupled mode), at every step the `--tis-batch-normalize` mean.

Weight sync: before each new rollout `push_weights` should load the trainer's current weights into the engine
(export them in the engine's format, then `SGLangClient.sync_weights_from_disk(path, weight_version=...)`); that
export depends on your model and checkpoint format and is left to you. Until then the rollout policy lags the
trainer: the mismatch metrics show it, and the correction accounts for it.
Pipeline parallelism is not supported (the lp_old pass runs whole micro-batches). Packed sequences neither.
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any

import torch

from slime_corr.arguments import add_rollout_correction_args, config_from_args  # slime_corr
from slime_corr.layout.groups import grpo_advantages, micro_batch_iterator, split_for_dp
from slime_corr.mcore.compat import import_megatron_training
from slime_corr.mcore.loss_hook import RolloutCorrectionLoss  # slime_corr
from slime_corr.mcore.rollout_steps import RolloutStepIterator  # slime_corr
from slime_corr.rollout.client import SGLangClient
from slime_corr.rollout.rollout import generate_group_samples

import_megatron_training()  # megatron.training also on Python 3.11 (see slime_corr.mcore.compat)

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.training import get_args, get_tokenizer, pretrain, print_rank_0  # noqa: E402
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args  # noqa: E402
from megatron.training.arguments import parse_and_validate_args  # noqa: E402

HOOK: RolloutCorrectionLoss | None = None  # built from the parsed flags in __main__


def add_args(parser):
    """Megatron-LM's `extra_args_provider`: slime_corr's flags plus this script's rollout flags (slime's names)."""
    add_rollout_correction_args(parser)  # slime_corr
    g = parser.add_argument_group(title="rollout (example)")
    g.add_argument("--sglang-url", nargs="+", required=True, help="SGLang server(s) or an sglang-router URL.")
    g.add_argument("--prompt-file", required=True, help="One prompt per line.")
    g.add_argument("--n-samples-per-prompt", type=int, default=8, help="GRPO group size.")
    g.add_argument("--rollout-temperature", type=float, default=1.0)
    g.add_argument("--rollout-max-response-len", type=int, default=1024)
    g.add_argument("--num-steps-per-rollout", type=int, default=1,
                   help="Optimizer steps trained on one rollout (lp_old is that rollout's first-step policy).")
    return parser


def reward(sample) -> float:
    """A toy reward (the fraction of even token ids): replace it with your task's (a verifier, a reward model)."""
    return sum(t % 2 == 0 for t in sample.response_tokens) / max(1, sample.response_length)


def push_weights(rollout_index: int) -> None:
    """Load the trainer's current weights into the engine before rollout `rollout_index` (see the module doc)."""
    if rollout_index > 0:
        print_rank_0(f"rollout {rollout_index}: the engine keeps its weights (push_weights is yours to write)")


def _generate(args, prompts: list[list[int]], rollout_index: int) -> list[Any]:
    """One rollout on global rank 0 (SGLang /generate with per-token log-probs, GRPO groups)."""
    async def run():
        params = {"temperature": args.rollout_temperature, "max_new_tokens": args.rollout_max_response_len}
        async with SGLangClient(args.sglang_url) as client:
            return await generate_group_samples(client, prompts, args.n_samples_per_prompt, params, stream=True,
                                                reward_fn=reward, group_id_offset=rollout_index * len(prompts))
    return asyncio.run(run())


def rollouts(args):
    """This rank's micro-batches, one rollout at a time: rank 0 samples, every rank takes its DP share, the
    micro-batches are CP-sliced; `global_batch_size · num_steps_per_rollout` samples per rollout."""
    tokenizer = get_tokenizer()
    with open(args.prompt_file) as f:
        prompts = [tokenizer.tokenize(line.rstrip("\n")) for line in f if line.strip()]
    per_rollout = args.global_batch_size * args.num_steps_per_rollout // args.n_samples_per_prompt
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    cp_rank, cp = ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()
    for r in range(args.train_iters // args.num_steps_per_rollout):
        push_weights(r)
        chunk = [prompts[(r * per_rollout + i) % len(prompts)] for i in range(per_rollout)]
        samples = [_generate(args, chunk, r) if torch.distributed.get_rank() == 0 else None]
        torch.distributed.broadcast_object_list(samples, src=0)
        advantages = dict(zip((s.index for s in samples[0]), grpo_advantages(samples[0]), strict=True))
        mine = split_for_dp(samples[0], dp_rank, dp)
        yield list(micro_batch_iterator(mine, args.micro_batch_size, [advantages[s.index] for s in mine],
                                        cp_rank=cp_rank, cp_size=cp))


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """With --dataloader-type external, pretrain() takes these as the data iterators."""
    return RolloutStepIterator(rollouts(get_args())), None, None  # slime_corr


def forward_step(data_iterator, model):
    """pretrain_gpt.py's forward_step with the rollout-correction loss."""
    batch = HOOK.next_micro_batch(data_iterator, model)  # slime_corr: prepares each step (lp_old, ...)
    logits = model(batch["tokens"], batch["position_ids"], None)
    return logits, partial(HOOK.loss_func, batch, model=model)  # slime_corr


def main() -> None:
    global HOOK
    args = parse_and_validate_args(extra_args_provider=add_args)
    config = config_from_args(args)  # slime_corr: validated flags (also against Megatron-LM's RL flags)
    HOOK = RolloutCorrectionLoss(config, temperature=args.rollout_temperature,  # slime_corr
                                 on_step_metrics=lambda m: print_rank_0(f"step correction metrics: {m}"))
    train_valid_test_datasets_provider.is_distributed = True  # every rank builds its iterator
    # the model: Megatron-LM's GPT from the flags, as pretrain_gpt.py builds it
    pretrain(pretrain_cfg_container_from_args(args, gpt_config_from_args(args)), train_valid_test_datasets_provider,
             ModelType.encoder_or_decoder, forward_step)


if __name__ == "__main__":
    main()
