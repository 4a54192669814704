"""Training under top-p / top-k sampling: the trainer's log-probs and the rollout's, both under the truncated,
renormalized distribution (Megatron glue around `truncated_logprobs`).

The engine samples y from μ_trunc(y) = μ(y) / M_μ on its nucleus N_μ (M_μ = μ(N_μ)), but returns log μ(y),
NOT renormalized (SGLang's `log_softmax(logits / T)[y]`). The trainer takes every policy log-prob under its own
truncation, lp_trunc(y) = log π(y) − log M_π on its nucleus N_π (−inf outside).

Where the engine's own nucleus is known (`--rollout-nucleus-logprobs`: its top-N log-probs held its top-k / top-p
boundary, `slime_corr.rollout.nucleus`; the micro-batch's `rollout_nucleus_log_mass` / `_known`), the
rollout log-prob is renormalized exactly, lp_rollout_trunc = lp_rollout − log M_μ = log μ_trunc(y), and the IS ratio
is π_old_trunc / μ_trunc. Elsewhere (the engine path off, or the boundary beyond the N) M_μ is unknown, and the
rollout log-prob is renormalized by the trainer's nucleus mass of the policy the rollout is compared with
(decoupled: π_old, from the lp_old pass; bypass: the training pass's π_θ, detached):

    lp_rollout_trunc = lp_rollout − log M_π_old

so the IS ratio π_old_trunc / μ_trunĉ = π_old(y) / μ(y) (the normalizers cancel) and the PPO ratio
π_θ_trunc / π_old_trunc carries the gradient of the truncated policy, −∇ log M_θ included. Remaining bias: the true
truncated ratio is (π_old / μ) · M_μ / M_π_old, so each token's weight is off by the factor M_π_old / M_μ, the
nucleus-mass mismatch of engine and trainer — zero when they agree, of the order of the log-prob mismatch itself,
and not one-signed (where the uncorrected π_trunc / μ is off by 1 / M ≥ 1, e.g. ≈ 1.1 at top_p = 0.9, always up).

The metrics count the paths: `mismatch_nucleus_engine_share` (valid tokens renormalized by the engine's mass; the
rest fell back to the trainer's), and on the engine path the mass mismatch log(M_π_old / M_μ) the fallback would
have left in the weight (`mismatch_nucleus_mass_log_ratio`, and its absolute value).

Tokens the engine sampled outside the trainer's nucleus (lp_trunc = −inf) leave the loss mask (per token, counted:
`mismatch_nucleus_disagreement`); tokens that leave the nucleus during the update (π_θ) are dropped by the loss's
non-finite guard (`pg_nonfinite_token_count`). Nothing non-finite stays in a batch.

Replay of the engine's kept sets (`--rollout-return-sampling-mask`: the micro-batch carries them,
`slime_corr.layout.kept_sets`). The trainer's nucleus is then not used for the log-probs: every policy log-prob of the
policy term (lp_old, lp and so the IS ratio's numerator, the PPO ratio and the policy gradient) is taken over the
engine's own kept set, log π_trunc(y) = z_y − log Σ_{v ∈ N_μ} e^{z_v} (`kept_set.kept_token_log_softmax`), and the
engine's mass is known at every token (from its support log-probs), so the IS ratio is exactly
π_old,trunc(y) / μ_trunc(y). The KL term and the entropy keep the FULL distribution (`replayed_log_probs` returns
its log-probs beside; the reference's are full), as a bonus or a penalty on the policy the engine truncates. The
log M this pass reports is the trainer's mass of the engine's kept set, M_π_old(N_μ). Metrics
(`kept_set_report`): `mismatch_kept_trainer_log_mass` (token mean of log M_π_old(N_μ)),
`mismatch_kept_outside_trainer_nucleus` (share of valid tokens the engine sampled outside the trainer's own
top-k / top-p set, when the hook knows the truncation), `mismatch_kept_abs_log_prob_diff` (mean over the kept ids of
valid tokens of |log π_trunc,train(v) − log μ_trunc(v)|, from the engine's support log-probs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from slime_corr.config import KernelBackend
from slime_corr.layout.kept_sets import KEPT_COUNTS_KEY, KEPT_IDS_KEY, KEPT_LOG_PROBS_KEY
from slime_corr.layout.micro_batch import NUCLEUS_KNOWN_KEY, NUCLEUS_MASS_KEY
from slime_corr.mcore.kept_set import kept_token_log_softmax
from slime_corr.mcore.logprobs import (
    DEFAULT_CHUNK_SIZE,
    LogSoftmaxSpec,
    ProcessGroup,
    token_log_softmax,
    tp_size,
)
from slime_corr.mcore.truncated_logprobs import label_in_nucleus, truncated_token_log_softmax

# batch keys: the engine's values, kept when the truncation replaces `rollout_log_probs` / `loss_mask`
UNTRUNCATED_ROLLOUT = "rollout_log_probs_untruncated"
UNTRUNCATED_MASK = "loss_mask_untruncated"
TRAINER_LOG_MASS = "nucleus_log_mass_trainer"  # the trainer's log M of the policy `renormalize_batch` was given
RENORMALIZED_KEYS = ("rollout_log_probs", "loss_mask", TRAINER_LOG_MASS)  # what `renormalize_batch` replaces
NUCLEUS_KEYS = ("mismatch_nucleus_disagreement", "mismatch_nucleus_log_mass", "mismatch_nucleus_ratio_mean",
                "mismatch_nucleus_uncorrected_ratio_mean", "mismatch_nucleus_engine_share",
                "mismatch_nucleus_mass_log_ratio", "mismatch_nucleus_mass_abs_log_ratio")
_LOG_RATIO_CLAMP = 20.0
# batch keys of the replay's metrics, set by the pass that renormalizes the batch: per position the sum of
# |log π_trunc,train(v) − log μ_trunc(v)| over its kept ids and how many were compared, and whether the sampled token
# lies outside the trainer's own nucleus
KEPT_ABS_DIFF_SUM, KEPT_COMPARED, KEPT_OUTSIDE_NUCLEUS = ("kept_abs_log_prob_diff_sum", "kept_compared_ids",
                                                          "kept_outside_trainer_nucleus")
KEPT_REPORT_KEYS = ("mismatch_kept_trainer_log_mass", "mismatch_kept_outside_trainer_nucleus",
                    "mismatch_kept_abs_log_prob_diff")


@dataclass(frozen=True)
class Truncation:
    """The rollout's top-p / top-k (SGLang's `top_p`, `top_k`; slime's `--rollout-top-p`, `--rollout-top-k`).
    `top_k` ≤ 0 is off (normalized to SGLang's −1), `top_p` = 1 is off."""

    top_p: float = 1.0
    top_k: int = -1

    def __post_init__(self) -> None:
        if not (isinstance(self.top_p, int | float) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"--rollout-top-p {self.top_p} must be in (0, 1] (1.0: no nucleus truncation).")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"--rollout-top-k {self.top_k!r} must be an integer (-1 or 0: off).")
        if self.top_k < -1:
            raise ValueError(f"--rollout-top-k {self.top_k} must be >= 1, or -1 / 0 to turn top-k off.")
        if self.top_k == 0:
            object.__setattr__(self, "top_k", -1)

    @property
    def active(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0

    def sampling_params(self) -> dict[str, float | int]:
        """The engine's sampling_params entries (SGLang's names and 'off' values)."""
        return {"top_p": float(self.top_p), "top_k": int(self.top_k)}


class NucleusLogProbs(NamedTuple):
    """Per position: lp_trunc (differentiable, −inf outside the nucleus), log M (the nucleus mass under the
    untruncated distribution, detached; 0 outside), in_nucleus, and the untruncated entropy when asked."""

    log_probs: Tensor
    log_mass: Tensor
    in_nucleus: Tensor
    entropy: Tensor | None


def nucleus_log_probs(logits: Tensor, labels: Tensor, truncation: Truncation, *, tp_group: ProcessGroup = None,
                      temperature: float = 1.0, chunk_size: int | None = DEFAULT_CHUNK_SIZE, with_entropy: bool = False,
                      entropy_grad: bool = True, backend: KernelBackend = "torch") -> NucleusLogProbs:
    """lp_trunc, log M = lse_N − lse_V, in_nucleus and the untruncated entropy in one pass of the trainer's
    log-prob function (`truncated_logprobs.truncated_token_log_softmax`; the entropy differentiable with
    `entropy_grad`)."""
    out = truncated_token_log_softmax(logits, labels, top_k=truncation.top_k, top_p=truncation.top_p,
                                      tp_group=tp_group, temperature=temperature, chunk_size=chunk_size,
                                      with_entropy=with_entropy, entropy_grad=entropy_grad, backend=backend)
    if out.in_kept is None:  # an inactive truncation: everything is kept
        return NucleusLogProbs(out.log_probs, torch.zeros_like(out.log_probs),
                               torch.ones_like(labels, dtype=torch.bool), out.entropy)
    assert out.log_mass is not None
    return NucleusLogProbs(out.log_probs, out.log_mass, out.in_kept, out.entropy)


class ReplayedLogProbs(NamedTuple):
    """A replay pass (module doc): `nucleus` (lp over the kept sets, log M_π(N_μ), in_nucleus all True, the full
    entropy), `full_log_probs` (the full distribution's, for the KL term; differentiable when asked), and per
    position this replay's metric parts (detached): Σ |Δ log π_trunc| over the kept ids, their count, and whether the
    sampled token is outside the trainer's own nucleus (None without a truncation)."""

    nucleus: NucleusLogProbs
    full_log_probs: Tensor
    abs_diff_sum: Tensor
    compared: Tensor
    outside_nucleus: Tensor | None


def replayed_log_probs(logits: Tensor, batch: dict[str, Tensor], *, truncation: Truncation | None = None,
                       tp_group: ProcessGroup = None, temperature: float = 1.0,
                       chunk_size: int | None = DEFAULT_CHUNK_SIZE, with_entropy: bool = False,
                       entropy_grad: bool = True, full_grad: bool = False,
                       backend: KernelBackend = "torch") -> ReplayedLogProbs:
    """The log-probs of a micro-batch that carries the engine's kept sets (module doc): over each token's kept set
    where it has one (`kept_set.kept_token_log_softmax`: gradient into the kept logits only), the full distribution's
    elsewhere (tokens the loss does not train); one pass of `logprobs.token_log_softmax` gives the full log-probs
    (differentiable with `full_grad`: a KL term), the entropy and log M_π(N_μ) = lp_full − lp_trunc. With
    `truncation`, also whether each sampled token is in the trainer's own nucleus (a metric: one more pass, no sort:
    `truncated_logprobs.label_in_nucleus`)."""
    labels = batch["labels"]
    spec = LogSoftmaxSpec(tp_group, temperature, chunk_size, with_entropy, with_entropy and entropy_grad,
                          backend=backend)
    with torch.set_grad_enabled(torch.is_grad_enabled() and (full_grad or spec.entropy_grad)):
        full = token_log_softmax(logits, labels, spec)
    kept = kept_token_log_softmax(logits, labels, batch[KEPT_COUNTS_KEY], batch[KEPT_IDS_KEY], tp_group=tp_group,
                                  temperature=temperature)
    has = kept.has_kept_set
    full_lp = full.log_probs.detach()
    log_probs = torch.where(has, kept.log_probs, full_lp)
    log_mass = torch.where(has, (full_lp - kept.log_probs.detach()).clamp_max(0.0), 0.0)
    nucleus = NucleusLogProbs(log_probs, log_mass, torch.ones_like(has), full.entropy)
    # the metric parts: |Δ| per kept id of this TP rank's shard, summed per position, then over TP
    n = labels.numel()
    sums = torch.zeros(2, n, dtype=torch.float64, device=labels.device)
    engine = batch.get(KEPT_LOG_PROBS_KEY)
    if engine is not None and engine.numel():
        counts = batch[KEPT_COUNTS_KEY].reshape(-1).long()
        rows = torch.repeat_interleave(torch.arange(n, device=counts.device), counts, output_size=engine.numel())
        theirs = engine.to(torch.float64)
        known = kept.kept_on_rank & ~theirs.isnan()
        diff = torch.where(known, kept.kept_log_probs.to(torch.float64) - theirs, 0.0).abs()
        sums[0].index_add_(0, rows, diff)
        sums[1].index_add_(0, rows, known.to(torch.float64))
    if engine is not None and tp_size(tp_group) > 1:
        dist.all_reduce(sums, group=tp_group)
    outside = None
    if truncation is not None and truncation.active:
        outside = has & ~label_in_nucleus(logits.detach(), labels, top_k=truncation.top_k, top_p=truncation.top_p,
                                          tp_group=tp_group, temperature=temperature, chunk_size=chunk_size)
    return ReplayedLogProbs(nucleus, full.log_probs, sums[0].reshape(labels.shape), sums[1].reshape(labels.shape),
                            outside)


def store_replay_metrics(batch: dict[str, Tensor], replayed: ReplayedLogProbs) -> None:
    """Keep a replay pass's metric parts in `batch` for `kept_set_report` (the pass that renormalizes it)."""
    batch[KEPT_ABS_DIFF_SUM], batch[KEPT_COMPARED] = replayed.abs_diff_sum, replayed.compared
    if replayed.outside_nucleus is not None:
        batch[KEPT_OUTSIDE_NUCLEUS] = replayed.outside_nucleus


def kept_set_report(batch: dict[str, Tensor], with_trainer_nucleus: bool) -> dict[str, Tensor]:
    """Megatron report pairs [numerator, denominator] (float64, local) of a renormalized micro-batch with kept sets
    (module doc), over its valid tokens (the loss mask before the truncation); `with_trainer_nucleus`: the hook knows
    the truncation (the share outside the trainer's nucleus is reported)."""
    valid = batch[UNTRUNCATED_MASK] > 0
    has = valid & (batch[KEPT_COUNTS_KEY] > 0)

    def pair(num: Tensor, den: Tensor) -> Tensor:
        return torch.stack([num.to(torch.float64), den.to(torch.float64)])

    zero = torch.zeros((), dtype=torch.float64, device=valid.device)
    trainer_mass = batch[TRAINER_LOG_MASS].to(torch.float64)
    diff, compared = batch.get(KEPT_ABS_DIFF_SUM), batch.get(KEPT_COMPARED)
    out = {
        "mismatch_kept_trainer_log_mass": pair(torch.where(has, trainer_mass, 0.0).sum(), has.sum()),
        "mismatch_kept_abs_log_prob_diff": pair(zero, zero) if diff is None else pair(
            torch.where(has, diff.to(torch.float64), 0.0).sum(), torch.where(has, compared.to(torch.float64), 0.0).sum()),
    }
    if with_trainer_nucleus:
        outside = batch.get(KEPT_OUTSIDE_NUCLEUS)
        out["mismatch_kept_outside_trainer_nucleus"] = pair(
            zero if outside is None else (valid & outside).sum(), valid.sum())
    return out


def engine_path(batch: dict[str, Tensor]) -> Tensor | None:
    """Where the engine's nucleus log-mass is known ([B, S] bool), None when the micro-batch carries none."""
    return batch.get(NUCLEUS_KNOWN_KEY)


def renormalize_batch(batch: dict[str, Tensor], nucleus: NucleusLogProbs) -> Tensor:
    """Put a micro-batch under the trainer's truncation, from the engine's values (kept under UNTRUNCATED_*, so
    calling it again with another nucleus starts afresh): `rollout_log_probs` := lp_rollout − log M_μ where the
    engine's mass is known (`engine_path`), lp_rollout − log M (the trainer's, `nucleus.log_mass`) elsewhere;
    `loss_mask` := mask · in_nucleus; the trainer's log M kept under TRAINER_LOG_MASS (for the metrics). Returns
    lp_trunc with the tokens outside the nucleus (now masked) set to the renormalized rollout log-prob, so it is
    finite everywhere (log-ratio 0 there)."""
    raw = batch.setdefault(UNTRUNCATED_ROLLOUT, batch["rollout_log_probs"])
    mask = batch.setdefault(UNTRUNCATED_MASK, batch["loss_mask"])
    lp = nucleus.log_probs.detach()
    log_mass = nucleus.log_mass
    known = engine_path(batch)
    if known is not None:
        log_mass = torch.where(known, batch[NUCLEUS_MASS_KEY].to(log_mass.dtype), log_mass)
    rollout = raw.to(lp.dtype) - log_mass
    batch[TRAINER_LOG_MASS] = nucleus.log_mass.detach()
    batch["rollout_log_probs"] = rollout.to(raw.dtype)
    batch["loss_mask"] = mask * nucleus.in_nucleus.to(mask.dtype)
    return torch.where(nucleus.in_nucleus, lp, rollout)


def nucleus_report(batch: dict[str, Tensor], lp_train: Tensor) -> dict[str, Tensor]:
    """Megatron report pairs [numerator, denominator] (float64, local; summed over micro-batches and DP×CP) of a
    renormalized micro-batch, lp_train being lp_old (decoupled) or the training pass's lp (bypass):
    `mismatch_nucleus_disagreement` = valid tokens outside the trainer's nucleus / valid tokens;
    `mismatch_nucleus_log_mass` = token mean of log M (the renormalization; ≤ 0);
    `mismatch_nucleus_ratio_mean` = token mean of π_train_trunc / μ_trunĉ (the corrected ratio) and
    `mismatch_nucleus_uncorrected_ratio_mean` = of π_train_trunc / μ (the rollout log-prob not renormalized), both
    on the tokens in the nucleus, log-ratios clamped to ±20;
    `mismatch_nucleus_engine_share` = valid tokens renormalized by the engine's own mass / valid tokens;
    `mismatch_nucleus_mass_log_ratio` / `_abs_log_ratio` = token mean of log(M_π_train / M_μ) / of its absolute
    value, over the tokens in the nucleus on the engine path."""
    valid = batch[UNTRUNCATED_MASK] > 0
    kept = batch["loss_mask"] > 0
    known = engine_path(batch)
    known = torch.zeros_like(kept) if known is None else known
    on_engine = kept & known
    trainer_mass = batch[TRAINER_LOG_MASS].to(torch.float64)
    mass_log_ratio = trainer_mass - batch.get(NUCLEUS_MASS_KEY, trainer_mass).to(torch.float64)
    raw = batch[UNTRUNCATED_ROLLOUT].to(torch.float64)
    rollout = batch["rollout_log_probs"].to(torch.float64)
    lp = torch.where(kept, lp_train.detach().to(torch.float64), rollout)
    lo, hi = -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP
    n_valid, n_kept, n_engine = (x.sum().to(torch.float64) for x in (valid, kept, on_engine))

    def kept_sum(x: Tensor, where: Tensor = kept) -> Tensor:
        return torch.where(where, x, 0.0).sum()

    def pair(num: Tensor, den: Tensor) -> Tensor:
        return torch.stack([num.to(torch.float64), den])

    return {
        "mismatch_nucleus_disagreement": pair((valid & ~kept).sum(), n_valid),
        "mismatch_nucleus_log_mass": pair(kept_sum(raw - rollout), n_kept),
        "mismatch_nucleus_ratio_mean": pair(kept_sum((lp - rollout).clamp(lo, hi).exp()), n_kept),
        "mismatch_nucleus_uncorrected_ratio_mean": pair(kept_sum((lp - raw).clamp(lo, hi).exp()), n_kept),
        "mismatch_nucleus_engine_share": pair((valid & known).sum(), n_valid),
        "mismatch_nucleus_mass_log_ratio": pair(kept_sum(mass_log_ratio, on_engine), n_engine),
        "mismatch_nucleus_mass_abs_log_ratio": pair(kept_sum(mass_log_ratio.abs(), on_engine), n_engine),
    }


__all__ = ["KEPT_REPORT_KEYS", "NUCLEUS_KEYS", "RENORMALIZED_KEYS", "TRAINER_LOG_MASS", "UNTRUNCATED_MASK",
           "UNTRUNCATED_ROLLOUT", "NucleusLogProbs", "ReplayedLogProbs", "Truncation", "engine_path", "kept_set_report",
           "nucleus_log_probs", "nucleus_report", "renormalize_batch", "replayed_log_probs", "store_replay_metrics"]
