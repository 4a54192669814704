"""Next-token sampling with SGLang's semantics, and ``sampling_seed`` draws keyed by (seed, position).

The random draw for the token at absolute sequence position ``p`` of a request with seed ``s`` comes from a
generator seeded with ``mix_seed(s, p)`` (as SGLang hashes seed and position): it depends on nothing else, so a
seeded request gives the same tokens whatever it was batched with, whenever it ran, and a request resumed from
``prompt + partial output`` with the same seed continues exactly as the uninterrupted one would have.
"""

from __future__ import annotations

import secrets
from typing import Any, NamedTuple

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


class SampledToken(NamedTuple):
    """One draw: the token, `engine_log_probs` [V], and with `with_support` the kept set the token was drawn from
    (SGLang's sampling mask: ids largest first) and each kept id's log-prob under the renormalized distribution
    (SGLang's support log-probs, float32 log(w / Σ w)); None otherwise."""

    token: int
    log_probs: torch.Tensor
    kept_ids: list[int] | None = None
    kept_log_probs: list[float] | None = None


def sample_token(logits: torch.Tensor, params: dict[str, Any], generator: torch.Generator | None,
                 with_support: bool = False) -> SampledToken:
    """Sample one token from float32 ``logits`` [V] with SGLang's semantics (`SampledToken`), the log-probs NOT
    renormalised after top-p / top-k / min-p filtering; ``T == 0`` is greedy (its kept set: the token, log-prob 0)."""
    logp = engine_log_probs(logits, params)
    if is_greedy(params):
        token = int(torch.argmax(logits))
        return SampledToken(token, logp, [token], [0.0]) if with_support else SampledToken(token, logp)
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
    weights = torch.where(keep, sorted_p, 0.0)
    token = int(order[torch.multinomial(weights, 1, generator=generator)])
    if not with_support:
        return SampledToken(token, logp)
    kept = weights[keep]
    return SampledToken(token, logp, order[keep].tolist(), torch.log(kept / kept.sum()).tolist())


def sample_next_token(
    logits: torch.Tensor, params: dict[str, Any], generator: torch.Generator | None
) -> tuple[int, float]:
    """Sample one token from float32 ``logits`` [V] with SGLang's semantics; returns (token, log-prob).

    log-prob = ``log_softmax(logits / T)[token]``, NOT renormalised after top-p / top-k / min-p filtering;
    ``T == 0`` is greedy with the log-prob of the raw logits.
    """
    tok, logp, _, _ = sample_token(logits, params, generator)
    return tok, float(logp[tok])


def top_log_probs(logp: torch.Tensor, num: int) -> tuple[list[float], list[int]]:
    """SGLang's ``top_logprobs_num`` entries of one position: the ``num`` largest of ``logp`` [V] (clamped to the
    smallest float32, as SGLang), sorted descending, and their token ids."""
    values, ids = logp.clamp_min(torch.finfo(torch.float32).min).topk(num)
    return values.tolist(), ids.tolist()
