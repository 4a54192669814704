"""The toy task of the main job: byte-level prompts and a verifiable reward the tiny model learns within a minute.

Prompts are short ASCII requests ("spell 42: "), drawn from a generator seeded by (`--seed`, rollout index), so a
rollout's prompts depend on nothing else (a resumed run gets the prompts the uninterrupted one had). The reward is
the fraction of response bytes that are lowercase ASCII letters: a random byte-level policy scores about
26/256 ≈ 0.1, a policy that writes words scores close to 1.
"""

from __future__ import annotations

import random

from slime_corr.rollout.sample import Sample

WORDS = ("hello", "count", "write", "spell", "lower", "story")
PROMPT_TOKENS_MAX = 16  # the longest prompt, in bytes ("story 99: " is 10)


def make_prompts(seed: int, rollout: int, n: int) -> list[list[int]]:
    """`n` prompts (byte tokens) for rollout number `rollout` of a run seeded with `seed`."""
    rng = random.Random(f"slime_corr-prompts-{seed}-{rollout}")
    return [list(f"{rng.choice(WORDS)} {rng.randint(0, 99)}: ".encode()) for _ in range(n)]


def reward_lowercase(sample: Sample) -> float:
    """Fraction of response tokens that are lowercase ASCII letters (the policy learns to write words)."""
    return sum(97 <= t <= 122 for t in sample.response_tokens) / max(1, len(sample.response_tokens))


__all__ = ["PROMPT_TOKENS_MAX", "make_prompts", "reward_lowercase"]
