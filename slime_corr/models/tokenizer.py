"""The checkpoint's own tokenizer and chat template, behind a small typed surface for the rollout and the engine.

The wrapper hides transformers version differences (`apply_chat_template` returns a list in 4.x, a
`BatchEncoding` in 5.x): a chat prompt is rendered as text with the template, then encoded without adding special
tokens (the template writes them), which is how the prompt text reaches SGLang's `/generate` as well.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from slime_corr.models.hf_checkpoint import MODEL_EXTRA_HINT, CheckpointError

Message = dict[str, str]  # {"role": "system"|"user"|"assistant", "content": str}


class ChatTokenizer:
    """Text <-> token ids and chat prompts of one checkpoint."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer
        if self.hf.eos_token_id is None:
            raise CheckpointError("the tokenizer defines no eos_token; generation could never stop")

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> ChatTokenizer:
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise ImportError(f"the checkpoint's tokenizer needs transformers: {MODEL_EXTRA_HINT}") from e
        return cls(AutoTokenizer.from_pretrained(str(path), local_files_only=True))

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def eos_token_id(self) -> int:
        return int(self.hf.eos_token_id)

    @property
    def pad_token_id(self) -> int:
        """The pad id (the EOS id when the tokenizer defines none; padded positions are masked anyway)."""
        pad = self.hf.pad_token_id
        return self.eos_token_id if pad is None else int(pad)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def chat_prompt(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """The chat template rendered as text (with the assistant header when `add_generation_prompt`)."""
        if not self.has_chat_template:
            raise CheckpointError("this tokenizer has no chat template; send plain text prompts instead")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}] = {m!r}: expected {{'role': str, 'content': str}}")
        return self.hf.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def chat_prompt_ids(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.chat_prompt(messages, add_generation_prompt))


__all__ = ["ChatTokenizer", "Message"]
