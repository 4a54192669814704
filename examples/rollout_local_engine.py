"""Rollout end to end on CPU: local engine -> GRPO samples -> advantages -> Megatron micro-batches -> weight sync.

    python examples/rollout_local_engine.py
"""

from __future__ import annotations

import asyncio
import tempfile

from slime_corr.rollout.batching import grpo_advantages, micro_batch_iterator
from slime_corr.rollout.client import SGLangClient
from slime_corr.rollout.engine_model import create_tiny_checkpoint
from slime_corr.rollout.local_engine import start_local_engine
from slime_corr.rollout.rollout import generate_group_samples


def reward(sample) -> float:
    """Toy reward: fraction of lowercase ASCII letters in the response."""
    return sum(97 <= t <= 122 for t in sample.response_tokens) / max(1, sample.response_length)


async def rollout(url: str, new_ckpt: str):
    async with SGLangClient(url) as client:
        prompts = [list(b"Question: 1+1="), list(b"Say hi: ")]
        samples = await generate_group_samples(client, prompts, n_samples_per_prompt=4,
                                               sampling_params={"max_new_tokens": 16, "temperature": 1.0},
                                               stream=True, reward_fn=reward)
        await client.sync_weights_from_disk(new_ckpt, weight_version="step-1")  # as the trainer would
        return samples, await client.model_info()


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        ckpt, ckpt1 = create_tiny_checkpoint(f"{d}/v0", seed=0), create_tiny_checkpoint(f"{d}/v1", seed=1)
        with start_local_engine(ckpt) as engine:
            samples, info = asyncio.run(rollout(engine.url, ckpt1))
    adv = grpo_advantages(samples)
    for s, a in zip(samples, adv, strict=True):
        print(f"group {s.group_id} #{s.index} {s.status.value:9s} len={s.response_length:2d} "
              f"reward={s.reward:.2f} adv={a:+.2f} mean logp={s.rollout_log_probs.mean():.3f}")
    for mb in micro_batch_iterator(samples, micro_batch_size=4, advantages=adv, cp_size=2, cp_rank=0):
        print({k: tuple(v.shape) for k, v in mb.items()})
    print("engine weight version after sync:", info["weight_version"])


if __name__ == "__main__":
    main()
