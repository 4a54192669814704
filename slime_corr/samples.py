"""The rollout sample: prompt + response tokens, loss mask, rollout log-probs, reward, status."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

import torch

from slime_corr.routed_experts import extend_routes


class SampleStatus(StrEnum):
    """How a sample ended. Every sample ends exactly once with one of these."""

    PENDING = "pending"
    COMPLETED = "completed"  # finish_reason stop (EOS / stop token / stop string)
    TRUNCATED = "truncated"  # finish_reason length (max_new_tokens or context length)
    ABORTED = "aborted"  # aborted (by the user or a pause) and not resumed: partial output kept
    FAILED = "failed"  # no usable output after bounded retries; see ``failure_reason``


class SampleValidationError(ValueError):
    """A sample field is inconsistent; the message starts with the field name."""


@dataclass
class Sample:
    """One rollout sample. Per-token fields are over ``response_tokens`` only.

    ``rollout_log_probs[i]`` is SGLang's log-prob of ``response_tokens[i]`` (fp32 tensor);
    ``loss_mask[i]`` is 1 for tokens the policy generated and trains on, 0 for tool / environment /
    other-turn tokens spliced into the response. ``weight_versions`` lists ``(version, start, end)``
    spans over response positions when generation was resumed across a weight update.
    ``routed_experts`` (MoE, when asked for): the engine's expert ids ``[rows, layers, top_k]`` (uint8 or int16,
    ``slime_corr.routed_experts``) of the sequence's tokens ``prompt + response`` from the first on; ``rows`` is
    ``total_length - 1`` once the last segment was generated (the last token was never a forward's input), fewer
    while spliced tool tokens wait for the next request to route them.
    ``rollout_nucleus_log_mass`` (top-p / top-k with the engine's top-N log-probs asked for): the engine's nucleus
    log-mass log M_μ of each response token (float32, ≤ 0), NaN where it is unknown (its nucleus did not fit in the
    top-N, or a segment without it); None when never asked for.
    The engine's kept sets (top-p / top-k with ``--rollout-return-sampling-mask``: SGLang's sampling mask), ragged
    under slime's names: ``rollout_top_p_token_ids`` [K] int32 and ``rollout_top_p_token_offsets`` [R + 1] int32,
    response token i's kept ids being ``ids[offsets[i]:offsets[i + 1]]`` (an empty set for a token without one,
    e.g. a tool's), and ``rollout_top_p_log_probs`` [K] float32, the engine's log-prob of each kept id under its
    renormalized distribution (SGLang's support log-probs; NaN where unknown); None when never asked for.
    """

    prompt_tokens: list[int]
    response_tokens: list[int] = field(default_factory=list)
    rollout_log_probs: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float32))
    loss_mask: list[int] | None = None
    reward: float | None = None
    group_id: int = 0
    index: int = 0
    weight_version: str | None = None
    weight_versions: list[tuple[str, int, int]] = field(default_factory=list)
    status: SampleStatus = SampleStatus.PENDING
    failure_reason: str | None = None
    attempts: int = 0
    metadata: dict = field(default_factory=dict)
    routed_experts: torch.Tensor | None = None
    rollout_nucleus_log_mass: torch.Tensor | None = None
    rollout_top_p_token_ids: torch.Tensor | None = None
    rollout_top_p_token_offsets: torch.Tensor | None = None
    rollout_top_p_log_probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rollout_log_probs, torch.Tensor):
            self.rollout_log_probs = torch.tensor(list(self.rollout_log_probs), dtype=torch.float32)
        if self.loss_mask is None:
            self.loss_mask = [1] * len(self.response_tokens)
        self.validate()

    @property
    def response_length(self) -> int:
        return len(self.response_tokens)

    @property
    def total_length(self) -> int:
        return len(self.prompt_tokens) + len(self.response_tokens)

    def validate(self) -> None:
        """Check types and lengths; raises :class:`SampleValidationError` naming the field."""
        n = len(self.response_tokens)
        if not self.prompt_tokens:
            raise SampleValidationError("prompt_tokens: must not be empty")
        for name in ("prompt_tokens", "response_tokens"):
            if not all(isinstance(t, int) and t >= 0 for t in getattr(self, name)):
                raise SampleValidationError(f"{name}: must be non-negative ints")
        lp = self.rollout_log_probs
        if lp.dtype != torch.float32:
            raise SampleValidationError(f"rollout_log_probs: dtype must be float32, got {lp.dtype}")
        if lp.dim() != 1 or lp.numel() != n:
            raise SampleValidationError(
                f"rollout_log_probs: length {lp.numel()} != len(response_tokens) {n}"
            )
        if n and not bool(torch.isfinite(lp).all()):
            raise SampleValidationError("rollout_log_probs: contains NaN or inf")
        if n and bool((lp > 1e-4).any()):
            raise SampleValidationError("rollout_log_probs: log-probs must be <= 0")
        assert self.loss_mask is not None
        if len(self.loss_mask) != n:
            raise SampleValidationError(f"loss_mask: length {len(self.loss_mask)} != len(response_tokens) {n}")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise SampleValidationError("loss_mask: values must be 0 or 1")
        if self.reward is not None and not math.isfinite(self.reward):
            raise SampleValidationError("reward: must be finite")
        r = self.routed_experts
        if r is not None:
            if r.dtype not in (torch.uint8, torch.int16) or r.dim() != 3:
                raise SampleValidationError(f"routed_experts: expected [tokens, layers, top_k] uint8/int16, got "
                                            f"{tuple(r.shape)} {r.dtype}")
            if r.shape[0] > self.total_length - 1:
                raise SampleValidationError(f"routed_experts: {r.shape[0]} rows for {self.total_length} tokens "
                                            f"(at most total_length - 1)")
        mass = self.rollout_nucleus_log_mass
        if mass is not None:
            if mass.dtype != torch.float32 or mass.dim() != 1 or mass.numel() != n:
                raise SampleValidationError(f"rollout_nucleus_log_mass: expected float32 [{n}] (one per response "
                                            f"token), got {mass.dtype} {tuple(mass.shape)}")
            known = mass[~mass.isnan()]
            if bool(known.isinf().any()) or bool((known > 1e-4).any()):
                raise SampleValidationError("rollout_nucleus_log_mass: values must be NaN (unknown) or finite <= 0")
        self._validate_kept_sets()
        if self.status == SampleStatus.FAILED and not self.failure_reason:
            raise SampleValidationError("failure_reason: required when status is failed")

    def _validate_kept_sets(self) -> None:
        """The ragged kept sets (class doc): int32 ids >= 0 and offsets of response_length + 1 non-decreasing
        entries from 0 to len(ids); log-probs (when given) float32, one per id, NaN or <= 0; every response token
        with a kept set among its ids, once."""
        ids, offsets, log_probs = (self.rollout_top_p_token_ids, self.rollout_top_p_token_offsets,
                                   self.rollout_top_p_log_probs)
        if ids is None and offsets is None and log_probs is None:
            return
        if ids is None or offsets is None:
            raise SampleValidationError("rollout_top_p_token_ids / rollout_top_p_token_offsets: give both or neither")
        n = self.response_length
        for name, t in (("rollout_top_p_token_ids", ids), ("rollout_top_p_token_offsets", offsets)):
            if t.dtype != torch.int32 or t.dim() != 1:
                raise SampleValidationError(f"{name}: expected a 1-D int32 tensor, got {t.dtype} {tuple(t.shape)}")
        if offsets.numel() != n + 1:
            raise SampleValidationError(f"rollout_top_p_token_offsets: {offsets.numel()} offsets for {n} response "
                                        "tokens (expected response_length + 1)")
        if int(offsets[0]) != 0 or int(offsets[-1]) != ids.numel() or bool((offsets.diff() < 0).any()):
            raise SampleValidationError(f"rollout_top_p_token_offsets: must rise from 0 to len(ids) = {ids.numel()}, "
                                        f"got {offsets[:3].tolist()}...{offsets[-1:].tolist()}")
        if ids.numel() and int(ids.min()) < 0:
            raise SampleValidationError("rollout_top_p_token_ids: ids must be >= 0")
        if log_probs is not None:
            if log_probs.dtype != torch.float32 or log_probs.shape != ids.shape:
                raise SampleValidationError(f"rollout_top_p_log_probs: expected float32 [{ids.numel()}] (one per kept "
                                            f"id), got {log_probs.dtype} {tuple(log_probs.shape)}")
            known = log_probs[~log_probs.isnan()]
            if bool(known.isinf().any()) or bool((known > 1e-4).any()):
                raise SampleValidationError("rollout_top_p_log_probs: values must be NaN (unknown) or finite <= 0")
        counts = offsets.diff().long()
        if ids.numel():
            token = torch.repeat_interleave(torch.arange(n), counts)
            sampled = torch.tensor(self.response_tokens, dtype=torch.long)[token]
            hits = torch.zeros(n, dtype=torch.long).index_add_(0, token, (ids.long() == sampled).long())
            bad = (counts > 0) & (hits != 1)
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                raise SampleValidationError(f"rollout_top_p_token_ids: response token {i} ({self.response_tokens[i]}) "
                                            f"is not exactly once in its kept set of {int(counts[i])} ids")

    def append_segment(
        self,
        tokens: list[int],
        log_probs: list[float],
        weight_version: str | None,
        trained: bool = True,
        spans: list[tuple[str, int, int]] | None = None,
        routed_experts: torch.Tensor | None = None,
        nucleus_log_mass: list[float] | None = None,
        kept_ids: list[list[int]] | None = None,
        kept_log_probs: list[list[float]] | None = None,
    ) -> None:
        """Append generated (``trained``) or tool/environment tokens (loss mask 0) and re-validate.

        ``spans``: the server's per-token weight versions for this segment (relative positions), when the
        weights changed during it (an in-place pause); otherwise the whole segment gets ``weight_version``.
        ``routed_experts``: the response's routes over its whole request (``routed_experts.extend_routes``).
        ``nucleus_log_mass``: the engine's nucleus log-mass of each token (NaN: unknown); a segment without it
        extends ``rollout_nucleus_log_mass`` with NaN once a segment had it (and the other way round).
        ``kept_ids`` / ``kept_log_probs``: each token's kept set and the engine's log-probs of it (SGLang's sampling
        mask); a segment without them adds empty sets once a segment had them (and the other way round), NaN
        log-probs where a segment had ids but none.
        """
        start = len(self.response_tokens)
        if spans and tokens:
            for v, a, b in spans:
                self.weight_versions.append((v, start + a, start + b))
            weight_version, spans_done = spans[-1][0], True
        else:
            spans_done = False
        self.response_tokens = self.response_tokens + list(tokens)
        self.rollout_log_probs = torch.cat(
            [self.rollout_log_probs, torch.tensor(log_probs, dtype=torch.float32).reshape(-1)]
        )
        self.loss_mask = list(self.loss_mask or []) + [1 if trained else 0] * len(tokens)
        if nucleus_log_mass is not None or self.rollout_nucleus_log_mass is not None:
            before = self.rollout_nucleus_log_mass
            before = torch.full((start,), torch.nan) if before is None else before
            added = torch.full((len(tokens),), torch.nan) if nucleus_log_mass is None else torch.tensor(
                nucleus_log_mass, dtype=torch.float32).reshape(-1)
            self.rollout_nucleus_log_mass = torch.cat([before, added])
        if kept_ids is not None or self.rollout_top_p_token_offsets is not None:
            self._append_kept_sets(start, len(tokens), kept_ids, kept_log_probs)
        if routed_experts is not None:
            self.routed_experts = extend_routes(self.routed_experts, routed_experts)
        if tokens and weight_version is not None:
            if not spans_done:
                self.weight_versions.append((weight_version, start, start + len(tokens)))
            self.weight_version = weight_version
        self.validate()

    def _append_kept_sets(self, start: int, added: int, kept_ids: list[list[int]] | None,
                          kept_log_probs: list[list[float]] | None) -> None:
        """Extend the ragged kept sets by `added` tokens (empty sets without `kept_ids`); the sample had `start`."""
        if kept_ids is not None and len(kept_ids) != added:
            raise SampleValidationError(f"rollout_top_p_token_ids: {len(kept_ids)} kept sets for {added} tokens")
        ids = self.rollout_top_p_token_ids
        ids = torch.zeros(0, dtype=torch.int32) if ids is None else ids
        offsets = self.rollout_top_p_token_offsets
        offsets = torch.zeros(start + 1, dtype=torch.int32) if offsets is None else offsets
        sets = kept_ids if kept_ids is not None else [[] for _ in range(added)]
        new_ids = torch.tensor([i for one in sets for i in one], dtype=torch.int32)
        sizes = torch.tensor([len(one) for one in sets], dtype=torch.int64)
        self.rollout_top_p_token_offsets = torch.cat([offsets, (offsets[-1] + sizes.cumsum(0)).to(torch.int32)])
        self.rollout_top_p_token_ids = torch.cat([ids, new_ids])
        if kept_log_probs is not None or self.rollout_top_p_log_probs is not None:
            before = self.rollout_top_p_log_probs
            before = torch.full((ids.numel(),), torch.nan) if before is None else before
            if kept_log_probs is None:
                values = torch.full((new_ids.numel(),), torch.nan)
            else:
                if [len(x) for x in kept_log_probs] != sizes.tolist():
                    raise SampleValidationError("rollout_top_p_log_probs: not one log-prob per kept id")
                values = torch.tensor([v for one in kept_log_probs for v in one], dtype=torch.float32)
            self.rollout_top_p_log_probs = torch.cat([before, values.to(torch.float32)])
