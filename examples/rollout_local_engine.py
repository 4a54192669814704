"""Rollout end to end on CPU: 2 local engines (behind sglang-router when installed) -> GRPO samples ->
advantages -> Megatron micro-batches -> weight sync to both engines over a gloo process group.

    python examples/rollout_local_engine.py
"""

from __future__ import annotations

import asyncio
import tempfile

from slime_corr.engines.embedded.engine import start_local_engine
from slime_corr.engines.embedded.model import create_tiny_checkpoint, load_tiny_lm
from slime_corr.engines.group import start_engine_group
from slime_corr.layout.groups import grpo_advantages, micro_batch_iterator
from slime_corr.rollout.client import SGLangClient
from slime_corr.rollout.rollout import generate_group_samples, rollout_report
from slime_corr.rollout.weight_sync import DistributedWeightSync


def reward(sample) -> float:
    """Toy reward: fraction of lowercase ASCII letters in the response."""
    return sum(97 <= t <= 122 for t in sample.response_tokens) / max(1, sample.response_length)


async def rollout(urls: list[str], trainer_ckpt: str):
    async with SGLangClient(urls) as client:
        prompts = [list(b"Question: 1+1="), list(b"Say hi: ")]
        samples = await generate_group_samples(client, prompts, n_samples_per_prompt=4,
                                               sampling_params={"max_new_tokens": 16, "temperature": 1.0},
                                               stream=True, reward_fn=reward)
        print("rollout:", rollout_report(samples, client).line())
        sync = DistributedWeightSync(client)  # as the trainer would, after its optimizer step
        try:
            report = await sync.sync(load_tiny_lm(trainer_ckpt).state_dict().items(), "step-1")
        finally:
            sync.close()
        print(f"weight sync: {report.bytes / 1e3:.0f} kB in {report.buckets} bucket(s) to {len(report.workers)} "
              f"engine(s) in {report.seconds * 1e3:.0f} ms")
        return samples, await client.weight_versions()


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        ckpt, ckpt1 = create_tiny_checkpoint(f"{d}/v0", seed=0), create_tiny_checkpoint(f"{d}/v1", seed=1)
        with start_engine_group(2, lambda i: start_local_engine(ckpt)) as group:
            print(group.describe())
            samples, versions = asyncio.run(rollout(group.urls, ckpt1))
    adv = grpo_advantages(samples)
    for s, a in zip(samples, adv, strict=True):
        print(f"group {s.group_id} #{s.index} {s.status.value:9s} len={s.response_length:2d} "
              f"reward={s.reward:.2f} adv={a:+.2f} mean logp={s.rollout_log_probs.mean():.3f}")
    for mb in micro_batch_iterator(samples, micro_batch_size=4, advantages=adv, cp_size=2, cp_rank=0):
        print({k: tuple(v.shape) for k, v in mb.items()})
    print("engine weight versions after sync:", versions)


if __name__ == "__main__":
    main()
