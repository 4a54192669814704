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


GREEDY_BELOW = 1e-6  # a temperature below this is greedy (SGLang's)


def is_greedy(params: dict[str, Any]) -> bool:
    return float(params.get("temperature", 1.0)) < GREEDY_BELOW


def engine_log_probs(logits: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """What the engine reports log-probs from, [V]: ``log_softmax(logits / T)`` (float32 ``logits``); the raw
    ``log_softmax(logits)`` when greedy (`is_greedy`), as SGLang."""
    if is_greedy(params):
        return torch.log_softmax(logits, dim=-1)
    return torch.log_softmax(logits / float(params.get("temperature", 1.0)), dim=-1)


def sample_token(logits: torch.Tensor, params: dict[str, Any], generator: torch.Generator | None
                 ) -> tuple[int, torch.Tensor]:
    """Sample one token from float32 ``logits`` [V] with SGLang's semantics; returns (token, `engine_log_probs`),
    the log-probs NOT renormalised after top-p / top-k / min-p filtering; ``T == 0`` is greedy."""
    logp = engine_log_probs(logits, params)
    if is_greedy(params):
        return int(torch.argmax(logits)), logp
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
    return int(order[torch.multinomial(torch.where(keep, sorted_p, 0.0), 1, generator=generator)]), logp


def sample_next_token(
    logits: torch.Tensor, params: dict[str, Any], generator: torch.Generator | None
) -> tuple[int, float]:
    """Sample one token from float32 ``logits`` [V] with SGLang's semantics; returns (token, log-prob).

    log-prob = ``log_softmax(logits / T)[token]``, NOT renormalised after top-p / top-k / min-p filtering;
    ``T == 0`` is greedy with the log-prob of the raw logits.
    """
    tok, logp = sample_token(logits, params, generator)
    return tok, float(logp[tok])


def top_log_probs(logp: torch.Tensor, num: int) -> tuple[list[float], list[int]]:
    """SGLang's ``top_logprobs_num`` entries of one position: the ``num`` largest of ``logp`` [V] (clamped to the
    smallest float32, as SGLang), sorted descending, and their token ids."""
    values, ids = logp.clamp_min(torch.finfo(torch.float32).min).topk(num)
    return values.tolist(), ids.tolist()
