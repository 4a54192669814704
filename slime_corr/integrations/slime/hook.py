"""slime's `--custom-tis-function-path` hook, computed by slime_corr's correction core.

slime's `policy_loss_function` (`slime/backends/megatron_utils/loss.py`) calls

    pg_loss, modified_masks, metrics = fn(args, pg_loss=..., train_log_probs=[...], rollout_log_probs=[...],
                                          loss_masks=[...], total_lengths=[...], response_lengths=[...])

with one entry per sample: this CP rank's part of the log-probs (slime's layout, `layout.py`), the WHOLE loss
mask, `pg_loss` the concatenated local per-token loss. It then reduces `pg_loss` with the returned masks and each
metric (a per-token tensor like `pg_loss`) with the original masks. Here the local parts are one packed row for
`compute_rollout_correction` (per-sequence sums over the CP group in one collective, batch statistics over CP
and DP: batch normalization over the micro-batch of every DP rank), then

    pg_loss ← pg_loss · w,   modified_masks ← whole-response masks after RS / veto / non-finite rejection
                             (mask mode: also the weights outside [L, U], as slime's mis.py),
    metrics ← slime_corr's metrics (and slime's names of them), each a batch value on every token.

Process groups come from Megatron's `parallel_state` (or `cp_group=` / `dp_group=` keywords).

Top-p / top-k replay: slime trains over the engine's kept sets (its `rollout_top_p_token_ids` /
`rollout_top_p_token_offsets`) itself, so `train_log_probs` are already log π_trunc. Given those keys (one entry
per sample, the whole response; offsets of response_length + 1, slime's meaning), the hook checks them against
`response_lengths` (a refusal names the key) and adds the kept-set metrics `kept_set_size_mean` and
`kept_set_singleton_share` over the trained tokens of the batch (all DP ranks). slime_corr's own trainer replays
the sets itself: `slime_corr.layout.kept_sets`.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.correction import Segments, compute_rollout_correction
from slime_corr.errors import ConfigError
from slime_corr.integrations.slime.config import MIS_KEYS, config_from_slime_args, effective_kind
from slime_corr.integrations.slime.layout import gather_whole, local_part, local_response_ranges
from slime_corr.integrations.slime.names import METRIC_NAMINGS, MIS_NAMES
from slime_corr.layout.kept_sets import SLIME_IDS_KEY, SLIME_OFFSETS_KEY

logger = logging.getLogger(__name__)
SLIME_OWN_KEYS = frozenset({"train_rollout_logprob_abs_diff"})
_CONFIGS: dict[tuple, tuple[RolloutCorrectionConfig, str, str]] = {}
_ARG_NAMES = ("use_tis", "tis_clip", "tis_clip_low", "use_rollout_logprobs", "rollout_correction_compile",
              "metric_names", *MIS_KEYS)


def hook_config(args: Any, kind: str = "mis") -> tuple[RolloutCorrectionConfig, str, str]:
    """(config, metric naming, effective kind) of slime's `args`, built once per distinct setting; notices are
    logged once. A bad setting raises `ConfigError` naming the YAML key / flag."""
    key = (kind, *(repr(getattr(args, n, None)) for n in _ARG_NAMES))
    if key not in _CONFIGS:
        try:
            config, notices = config_from_slime_args(args, kind)
        except ConfigError as e:
            raise ConfigError(f"slime_corr's slime hook ({kind}), settings from args / --custom-config-path: "
                              f"{e}") from None
        for notice in notices:
            logger.warning("slime_corr: %s", notice)
        naming = getattr(args, "metric_names", None) or "both"
        if naming not in METRIC_NAMINGS:
            raise ConfigError(f"metric_names {naming!r} is not one of {', '.join(METRIC_NAMINGS)}.")
        _CONFIGS[key] = (config, naming, effective_kind(args, kind))
    return _CONFIGS[key]


def parallel_groups() -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(CP group, DP group without CP) of Megatron's parallel state; None for a size-1 or uninitialized one."""
    try:
        from megatron.core import parallel_state as ps
    except ImportError:
        return None, None
    if not ps.model_parallel_is_initialized():
        return None, None
    cp = ps.get_context_parallel_group() if ps.get_context_parallel_world_size() > 1 else None
    dp = ps.get_data_parallel_group() if ps.get_data_parallel_world_size() > 1 else None
    return cp, dp


def _check_samples(train_log_probs: Sequence[Tensor], rollout_log_probs: Sequence[Tensor],
                   loss_masks: Sequence[Tensor], total_lengths: Sequence[int], response_lengths: Sequence[int]) -> None:
    """One entry per sample everywhere; each sample's lengths consistent (before any CP slicing)."""
    counts = {len(x) for x in (train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths)}
    if len(counts) != 1:
        raise ValueError(f"slime hook: train_log_probs, rollout_log_probs, loss_masks, total_lengths, "
                         f"response_lengths must have one entry per sample, got lengths {sorted(counts)}.")
    for i, (m, t, n) in enumerate(zip(loss_masks, total_lengths, response_lengths, strict=True)):
        if not 0 <= n <= t:
            raise ValueError(f"slime hook: sample {i}: response_length {n} and total_length {t}: a response is part "
                             "of its sample (0 <= response_length <= total_length, prompt + response tokens).")
        if m.numel() != n:
            raise ValueError(f"slime hook: sample {i}: loss_masks has {m.numel()} entries, response_length {n}: "
                             "slime's loss mask covers the whole response, on every CP rank.")


def _check_local(train_log_probs: Sequence[Tensor], rollout_log_probs: Sequence[Tensor],
                 local_masks: Sequence[Tensor], total_lengths: Sequence[int], response_lengths: Sequence[int]) -> None:
    for i, (t, r, m) in enumerate(zip(train_log_probs, rollout_log_probs, local_masks, strict=True)):
        if not (t.shape == r.shape == m.shape):
            raise ValueError(f"slime hook: sample {i}: train_log_probs {tuple(t.shape)}, rollout_log_probs "
                             f"{tuple(r.shape)} and this CP rank's part of loss_masks {tuple(m.shape)} differ "
                             f"(total_length {total_lengths[i]}, response_length {response_lengths[i]}).")


def _kept_set_metrics(ids: Sequence[Any] | None, offsets: Sequence[Any] | None, loss_masks: Sequence[Tensor],
                      response_lengths: Sequence[int], dp_group: dist.ProcessGroup | None,
                      device: torch.device) -> dict[str, Tensor]:
    """slime's kept sets (module doc) checked, and the mean size and singleton share of the trained tokens' sets
    over the batch of every DP rank (one all-reduce); {} without them."""
    if ids is None and offsets is None:
        return {}
    if ids is None or offsets is None or len(ids) != len(response_lengths) or len(offsets) != len(response_lengths):
        raise ValueError(f"slime hook: {SLIME_IDS_KEY} and {SLIME_OFFSETS_KEY} come together, one entry per sample "
                         f"({len(response_lengths)} samples)")
    sums = torch.zeros(3, dtype=torch.float64)
    for i, (k, o, m, n) in enumerate(zip(ids, offsets, loss_masks, response_lengths, strict=True)):
        o = torch.as_tensor(o).long().reshape(-1)
        count = torch.as_tensor(k).numel()
        if o.numel() != n + 1 or int(o[0]) != 0 or int(o[-1]) != count or bool((o.diff() < 0).any()):
            raise ValueError(f"slime hook: {SLIME_OFFSETS_KEY}[{i}] has {o.numel()} offsets (from {int(o[0])} to "
                             f"{int(o[-1])}) for a response of {n} tokens with {count} kept ids: expected "
                             "response_length + 1 non-decreasing offsets from 0 to len(ids)")
        sizes = o.diff()[m.detach().cpu().reshape(-1) > 0].to(torch.float64)
        sums += torch.stack([sizes.sum(), (sizes == 1).sum().to(torch.float64), torch.tensor(sizes.numel() * 1.0)])
    sums = sums.to(device)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(sums, group=dp_group)
    tokens = sums[2].clamp_min(1.0)
    return {"kept_set_size_mean": sums[0] / tokens, "kept_set_singleton_share": sums[1] / tokens}


def _per_token(metrics: dict[str, Tensor], n: int, dtype: torch.dtype) -> dict[str, Tensor]:
    return {k: v.detach().to(dtype).expand(n) for k, v in metrics.items()}


def _apply(kind: str, args: Any, *, pg_loss: Tensor, train_log_probs: Sequence[Tensor],
           rollout_log_probs: Sequence[Tensor], loss_masks: Sequence[Tensor], total_lengths: Sequence[int],
           response_lengths: Sequence[int], cp_group: dist.ProcessGroup | None = None,
           dp_group: dist.ProcessGroup | None = None, kept_ids: Sequence[Any] | None = None,
           kept_offsets: Sequence[Any] | None = None) -> tuple[Tensor, list[Tensor], dict[str, Tensor]]:
    config, naming, kind = hook_config(args, kind)
    if cp_group is None and dp_group is None:
        cp_group, dp_group = parallel_groups()
    cp_rank, cp_size = (dist.get_rank(cp_group), dist.get_world_size(cp_group)) if cp_group else (0, 1)
    _check_samples(train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths)
    local_masks = [local_part(m, local_response_ranges(t, n, cp_rank, cp_size))
                   for m, t, n in zip(loss_masks, total_lengths, response_lengths, strict=True)]
    _check_local(train_log_probs, rollout_log_probs, local_masks, total_lengths, response_lengths)
    device = pg_loss.device
    lens = [t.numel() for t in train_log_probs]
    n_tok = sum(lens)
    if pg_loss.shape != (n_tok,):
        raise ValueError(f"slime hook: pg_loss has shape {tuple(pg_loss.shape)}; expected ({n_tok},), this CP rank's "
                         "response tokens of every sample concatenated, as train_log_probs are.")
    lp = torch.cat([t.detach() for t in train_log_probs]).unsqueeze(0)
    ro = torch.cat(list(rollout_log_probs)).detach().to(lp.device).unsqueeze(0)
    mask = (torch.cat(local_masks).to(device) > 0).unsqueeze(0)
    offsets = torch.tensor([0, *itertools.accumulate(lens)], device=device)
    result = compute_rollout_correction(lp, ro, mask, config, cp_group=cp_group, dp_group=dp_group,
                                        segments=Segments.packed_row(offsets, n_tok))
    modified = list(loss_masks)
    if result.weights is not None:
        pg_loss = pg_loss * result.weights[0].to(pg_loss.dtype)
    if config.use_rollout_correction:
        final = result.loss_mask[0]
        if kind == "mis" and config.tis_mode == "mask" and result.weights is not None:
            final = final * (result.weights[0] > 0)  # slime's mis.py drops them from the mask too
        whole = gather_whole(final, total_lengths, response_lengths, cp_group)
        modified = [w.to(m.dtype) for w, m in zip(whole, loss_masks, strict=True)]

    dtype = torch.promote_types(pg_loss.dtype, torch.float32)
    metrics: dict[str, Tensor] = _per_token(_kept_set_metrics(kept_ids, kept_offsets, loss_masks, response_lengths,
                                                              dp_group, device), n_tok, dtype)
    if naming != "slime":  # not the keys slime's policy_loss_function logs itself
        metrics.update(_per_token({k: v for k, v in result.metrics.items() if k not in SLIME_OWN_KEYS}, n_tok,
                                  dtype))
    if naming != "slime_corr":
        if kind in ("mis", "metrics"):
            metrics.update(_per_token({MIS_NAMES[k]: v for k, v in result.metrics.items() if k in MIS_NAMES},
                                      n_tok, dtype))
        else:  # slime's vanilla_tis_function / icepop_function keys, per token
            ratio = (lp[0] - ro[0]).to(dtype).exp()
            lower, upper = config.tis_bounds
            metrics.update(tis=ratio, tis_abs=(ratio - 1).abs(),
                           tis_clipfrac=((ratio < lower) | (ratio > upper)).to(dtype))
    return pg_loss, modified, metrics


def compute_mis_weights_with_cp(args: Any, *, pg_loss: Tensor, train_log_probs: list[Tensor],
                                rollout_log_probs: list[Tensor], loss_masks: list[Tensor], total_lengths: list[int],
                                response_lengths: list[int], **kwargs: Any
                                ) -> tuple[Tensor, list[Tensor], dict[str, Tensor]]:
    """slime_corr's full correction with slime's mis.py settings (`args` and its `--custom-config-path` YAML;
    see `slime_corr.integrations.slime.config`): IS at every level and mode, RS, veto, batch normalization,
    non-finite rejection, the metrics. Without mis.py settings and with `--use-tis`: `vanilla_tis_function`."""
    return _apply("mis", args, pg_loss=pg_loss, train_log_probs=train_log_probs,
                  rollout_log_probs=rollout_log_probs, loss_masks=loss_masks, total_lengths=total_lengths,
                  response_lengths=response_lengths, cp_group=kwargs.get("cp_group"),
                  dp_group=kwargs.get("dp_group"), kept_ids=kwargs.get(SLIME_IDS_KEY),
                  kept_offsets=kwargs.get(SLIME_OFFSETS_KEY))


def vanilla_tis_function(args: Any, *, pg_loss: Tensor, train_log_probs: list[Tensor],
                         rollout_log_probs: list[Tensor], loss_masks: list[Tensor], total_lengths: list[int],
                         response_lengths: list[int], **kwargs: Any) -> tuple[Tensor, list[Tensor], dict[str, Tensor]]:
    """slime's default TIS: w = clamp(π_train/π_rollout, tis_clip_low, tis_clip) per token."""
    return _apply("vanilla", args, pg_loss=pg_loss, train_log_probs=train_log_probs,
                  rollout_log_probs=rollout_log_probs, loss_masks=loss_masks, total_lengths=total_lengths,
                  response_lengths=response_lengths, cp_group=kwargs.get("cp_group"),
                  dp_group=kwargs.get("dp_group"), kept_ids=kwargs.get(SLIME_IDS_KEY),
                  kept_offsets=kwargs.get(SLIME_OFFSETS_KEY))


def icepop_function(args: Any, *, pg_loss: Tensor, train_log_probs: list[Tensor],
                    rollout_log_probs: list[Tensor], loss_masks: list[Tensor], total_lengths: list[int],
                    response_lengths: list[int], **kwargs: Any) -> tuple[Tensor, list[Tensor], dict[str, Tensor]]:
    """slime's IcePop: w = π_train/π_rollout where it is in [tis_clip_low, tis_clip], else 0 (the mask is kept)."""
    return _apply("icepop", args, pg_loss=pg_loss, train_log_probs=train_log_probs,
                  rollout_log_probs=rollout_log_probs, loss_masks=loss_masks, total_lengths=total_lengths,
                  response_lengths=response_lengths, cp_group=kwargs.get("cp_group"),
                  dp_group=kwargs.get("dp_group"), kept_ids=kwargs.get(SLIME_IDS_KEY),
                  kept_offsets=kwargs.get(SLIME_OFFSETS_KEY))


tis_function = compute_mis_weights_with_cp

__all__ = ["compute_mis_weights_with_cp", "hook_config", "icepop_function", "parallel_groups", "tis_function",
           "vanilla_tis_function"]
