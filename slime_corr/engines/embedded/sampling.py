"""Next-token sampling with SGLang's semantics, and ``sampling_seed`` draws keyed by (seed, position).

The random draw for the token at absolute sequence position ``p`` of a request with seed ``s`` comes from a
generator seeded with ``mix_seed(s, p)`` (as SGLang hashes seed and position): it depends on nothing else, so a
seeded request gives the same tokens whatever it was batched with, whenever it ran, and a request resumed from
``prompt + partial output`` with the same seed continues exactly as the uninterrupted one would have.
"""

from __future__ import annotations

import secrets
from typing import Any

import torch

from slime_corr.rollout.sampling import mix_seed


def request_seed(params: dict[str, Any]) -> int:
    """``sampling_params.sampling_seed``, or a fresh random seed when the request has none."""
    seed = params.get("sampling_seed")
    return secrets.randbits(63) if seed is None else int(seed)


def position_generator(seed: int, position: int) -> torch.Generator:
    """The generator of the draw at ``position`` for ``seed``."""
    return torch.Generator().manual_seed(mix_seed(seed, position))


def sample_next_token(
    logits: torch.Tensor, params: dict[str, Any], generator: torch.Generator | None
) -> tuple[int, float]:
    """Sample one token from float32 ``logits`` [V] with SGLang's semantics; returns (token, log-prob).

    log-prob = ``log_softmax(logits / T)[token]``, NOT renormalised after top-p / top-k / min-p filtering;
    ``T == 0`` is greedy with the log-prob of the raw logits.
    """
    temperature = float(params.get("temperature", 1.0))
    if temperature < 1e-6:  # greedy; log-prob of the raw logits
        tok = int(torch.argmax(logits))
        return tok, float(torch.log_softmax(logits, dim=-1)[tok])
    logp = torch.log_softmax(logits / temperature, dim=-1)
    # SGLang's filter, on the probabilities sorted once: top-p on the cumulative sum of the FULL distribution,
    # top-k by rank, min-p relative to the largest probability; then sample among what is left.
    sorted_p, order = torch.sort(logp.exp(), descending=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    top_p = float(params.get("top_p", 1.0))
    if top_p < 1.0:
        keep &= (torch.cumsum(sorted_p, 0) - sorted_p) <= top_p
    top_k = int(params.get("top_k", -1) or -1)
    if 0 < top_k < sorted_p.numel():
        keep[top_k:] = False
    min_p = float(params.get("min_p", 0.0))
    if min_p > 0.0:
        keep &= sorted_p >= sorted_p[0] * min_p
    tok = int(order[torch.multinomial(torch.where(keep, sorted_p, 0.0), 1, generator=generator)])
    return tok, float(logp[tok])  # NOT renormalised after filtering
