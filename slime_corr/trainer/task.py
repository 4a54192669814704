"""The main job's tasks: prompts and a verifiable reward, selected by `--task` from a small registry.

A task draws each rollout's prompts from a generator seeded by (`--seed`, rollout index), so a rollout's prompts
depend on nothing else (a resumed run gets the prompts the uninterrupted one had), and scores a response by code.

- `lowercase` (the tiny byte-level model's): requests like "spell 42: "; reward = the fraction of response tokens
  that are lowercase ASCII letters (byte tokens). A random byte-level policy scores about 26/256 ≈ 0.1, a policy
  that writes words close to 1.
- `arithmetic` (a pretrained chat model's): "a + b" with a, b in 0..9 after a system prompt asking for the result
  only; reward 1 when the last integer in the response text is a + b, else 0. SmolLM2-135M-Instruct at temperature
  0.7 with 8 response tokens starts near 0.35 (it talks, and 8 tokens cut most sentences short) and learns to
  answer ("4 + 5 = 9.") within a few rollouts (docs/models.md).

A prompt is chat messages: a tokenizer with a chat template renders them (`ChatTokenizer.chat_prompt_ids`), the
byte-level one encodes the user message's text alone.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Message = dict[str, str]


@dataclass(frozen=True)
class TaskPrompt:
    """One prompt: chat messages, and what the reward checks the response against (`label`)."""

    messages: tuple[Message, ...]
    label: str | None = None

    @property
    def text(self) -> str:
        """The user message's text (the prompt of a tokenizer without chat template)."""
        return next(m["content"] for m in reversed(self.messages) if m["role"] == "user")


@dataclass(frozen=True)
class Response:
    """What a reward sees: the response text (special tokens skipped), its token ids, the prompt's label."""

    text: str
    tokens: Sequence[int]
    label: str | None


@dataclass(frozen=True)
class Task:
    name: str
    description: str
    draw: Callable[[random.Random], TaskPrompt]  # one prompt from the rollout's generator
    reward: Callable[[Response], float]
    max_prompt_chars: int  # the longest user message (the tiny model's positions are checked against it)
    byte_tokens_only: bool = False  # its reward counts byte tokens: only for the byte-level tiny model

    def prompts(self, seed: int, rollout: int, n: int) -> list[TaskPrompt]:
        """`n` prompts for rollout number `rollout` of a run seeded with `seed`."""
        rng = random.Random(f"slime_corr-prompts-{seed}-{rollout}")
        return [self.draw(rng) for _ in range(n)]


def encode_prompt(tokenizer: Any, prompt: TaskPrompt) -> list[int]:
    """Token ids of `prompt`: the chat template when the tokenizer has one, else the user text's ids."""
    if getattr(tokenizer, "has_chat_template", False):
        return tokenizer.chat_prompt_ids(list(prompt.messages))
    return list(tokenizer.encode(prompt.text))


# ---------------------------------------------------------------------------------------------- lowercase
WORDS = ("hello", "count", "write", "spell", "lower", "story")


def _draw_lowercase(rng: random.Random) -> TaskPrompt:
    return TaskPrompt(({"role": "user", "content": f"{rng.choice(WORDS)} {rng.randint(0, 99)}: "},))


def reward_lowercase(response: Response) -> float:
    """Fraction of response tokens that are lowercase ASCII letters (byte tokens: the policy learns to write
    words)."""
    return sum(97 <= t <= 122 for t in response.tokens) / max(1, len(response.tokens))


# ---------------------------------------------------------------------------------------------- arithmetic
ARITHMETIC_SYSTEM = "You are a calculator. Reply with only the result."
_INTEGER = re.compile(r"-?\d+")


def _draw_arithmetic(rng: random.Random) -> TaskPrompt:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return TaskPrompt(({"role": "system", "content": ARITHMETIC_SYSTEM}, {"role": "user", "content": f"{a} + {b}"}),
                      label=str(a + b))


def reward_last_integer(response: Response) -> float:
    """1.0 when the last integer in the response text equals the label, else 0.0."""
    numbers = _INTEGER.findall(response.text)
    return float(bool(numbers) and numbers[-1] == response.label)


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task("lowercase", "byte-level requests ('spell 42: '); reward: fraction of lowercase-letter byte tokens",
             _draw_lowercase, reward_lowercase, max_prompt_chars=16, byte_tokens_only=True),
        Task("arithmetic", "'a + b' (one digit each) after a calculator system prompt; reward 1 when the response's "
             "last integer is the sum", _draw_arithmetic, reward_last_integer, max_prompt_chars=8),
    )
}


__all__ = ["TASKS", "Response", "Task", "TaskPrompt", "encode_prompt", "reward_last_integer", "reward_lowercase"]
