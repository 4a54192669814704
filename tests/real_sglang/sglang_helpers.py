"""Helpers of the real-SGLang tests: the trainer's teacher-forced log-probs of sampled sequences."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mcore"))  # mcore_helpers (run_in_process)


def megatron_logprobs(version_dir: str, sequences: list[tuple[list[int], list[int]]], temperature: float) -> list:
    """Teacher-forced log-probs of each (prompt, response) under the trainer's model (Megatron GPTModel, fp32) and
    its log-prob path (`vocab_parallel_log_probs`), in a one-rank gloo group in this process."""
    from mcore_helpers import run_in_process

    result: list = []

    def fn(rank: int, world: int) -> None:
        from mcore_helpers import init_layout

        from slime_corr.mcore.logprobs import vocab_parallel_log_probs
        from slime_corr.mcore.model import TinyGPTArgs, build_tiny_gpt

        init_layout(1, 1)
        model = build_tiny_gpt(TinyGPTArgs(vocab_size=256), ddp=False).eval()
        model.load_state_dict(torch.load(Path(version_dir) / "megatron.pt", weights_only=True), strict=False)
        for prompt, response in sequences:
            ids = torch.tensor([prompt + response])
            with torch.no_grad():
                logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], attention_mask=None)
            lp = vocab_parallel_log_probs(logits[:, len(prompt) - 1:-1], ids[:, len(prompt):],
                                          temperature=temperature)
            result.append(lp[0])

    run_in_process(fn)
    return result


@dataclass(frozen=True)
class ServerSpec:
    model_path: str
    dtype: str = "float32"
    extra_args: tuple[str, ...] = ()
    name: str = "sglang"
