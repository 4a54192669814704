"""slime's formulas, re-derived from its public source (THUDM/slime: examples/train_infer_mismatch_helper/mis.py,
slime/backends/megatron_utils/loss.py and cp_utils.py) as plain full-tensor code, and slime-shaped call inputs.

Written from the formulas, not from slime's code: the tests compare slime_corr's hook against these.
"""

from __future__ import annotations

import argparse
import math

import torch
import yaml

SAFETY = 20.0


def slime_args(**overrides) -> argparse.Namespace:
    """The namespace slime's parser gives (the flags the TIS path reads, with slime's defaults)."""
    args = argparse.Namespace(use_tis=False, tis_clip=2.0, tis_clip_low=0.0, custom_tis_function_path=None,
                              custom_config_path=None, get_mismatch_metrics=False, use_rollout_logprobs=False,
                              calculate_per_token_loss=False, loss_type="policy_loss", kl_coef=0.0)
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


def apply_yaml(args: argparse.Namespace, path: str) -> argparse.Namespace:
    """What slime's parse_args does with --custom-config-path: every key set on args (the YAML wins)."""
    args.custom_config_path = path
    with open(path) as f:
        for k, v in (yaml.safe_load(f) or {}).items():
            setattr(args, k, v)
    return args


def _agg(d: torch.Tensor, m: torch.Tensor, level: str) -> torch.Tensor:
    if level == "token":
        return d
    s = (d * m).sum()
    if level == "geometric":
        s = s / m.sum().clamp_min(1)
    return s.expand_as(d)


def mis_reference(args, train, rollout, masks):
    """slime's compute_mis_weights on whole sequences: (weights, modified masks), per sample."""
    upper = args.tis_upper_bound
    lower = args.tis_lower_bound if args.tis_lower_bound is not None else 1.0 / upper
    rs_lower = args.rs_lower_bound if getattr(args, "rs_lower_bound", None) is not None else lower
    rs_upper = args.rs_upper_bound if getattr(args, "rs_upper_bound", None) is not None else upper
    weights, mods = [], []
    for t, r, m in zip(train, rollout, masks, strict=True):
        m = m.double()
        d = t.double() - r.double()
        w = _agg(d, m, args.tis_level).clamp(-SAFETY, SAFETY).exp()
        mod = m.clone()
        if args.tis_mode == "truncate":
            w = w.clamp(0, upper) * m
        elif args.tis_mode == "clip":
            w = w.clamp(lower, upper) * m
        else:
            mod = m * ((w >= lower) & (w <= upper)).double()
            w = w * m
        if getattr(args, "use_rs", False):
            rw = _agg(d, m, args.rs_level).clamp(-SAFETY, SAFETY).exp()
            mod = mod * ((rw >= rs_lower) & (rw <= rs_upper)).double()
            if args.rs_veto_threshold is not None:
                mod = mod * float(not ((d < math.log(args.rs_veto_threshold)) & (m > 0)).any())
        weights.append(w)
        mods.append(mod)
    if getattr(args, "tis_batch_normalize", False):
        if args.tis_level == "token":
            mean = sum((w * m).sum() for w, m in zip(weights, masks, strict=True)) / sum(m.sum() for m in masks)
        else:  # sequence (slime refuses geometric)
            mean = sum((w * m).sum() / m.sum().clamp_min(1) for w, m in zip(weights, masks, strict=True)) / len(masks)
        if mean > 1e-8:
            weights = [w / mean for w in weights]
    return weights, mods


def vanilla_reference(args, train, rollout):
    """slime's vanilla_tis_function: (per-token weights, tis, tis_clipfrac, tis_abs) of the concatenation."""
    ratio = (torch.cat(train).double() - torch.cat(rollout).double()).exp()
    w = ratio.clamp(args.tis_clip_low, args.tis_clip)
    return w, ratio, (w != ratio).double(), (ratio - 1).abs()


def icepop_reference(args, train, rollout):
    ratio = (torch.cat(train).double() - torch.cat(rollout).double()).exp()
    w = torch.where((ratio >= args.tis_clip_low) & (ratio <= args.tis_clip), ratio, torch.zeros_like(ratio))
    return w, ratio, (w != ratio).double(), (ratio - 1).abs()


def sum_of_sample_mean(x, masks, denominators=None):
    """slime's reducer on whole sequences: Σ_i Σ_t x·m_i / max(D_i, 1), D_i = Σ original mask by default."""
    out, start = 0.0, 0
    for i, m in enumerate(masks):
        n = m.numel()
        den = denominators[i] if denominators is not None else m.sum()
        out = out + (x[start:start + n] * m).sum() / max(float(den), 1.0)
        start += n
    return out


def cp_slice(values: torch.Tensor, total_length: int, response_length: int, cp_rank: int, cp_size: int):
    """slime's slice_log_prob_with_cp: this CP rank's part of a response-indexed tensor."""
    if cp_size == 1:
        return values
    prompt = total_length - response_length
    chunk = (total_length + 2 * cp_size - 1) // (2 * cp_size)
    parts = []
    for c in (cp_rank, 2 * cp_size - cp_rank - 1):
        lo, hi = max(c * chunk, prompt - 1), min((c + 1) * chunk, total_length - 1)
        if not lo < hi:
            lo, hi = 0, 0
        parts.append(values[lo - (prompt - 1): hi - (prompt - 1)] if hi > lo else values[:0])
    return torch.cat(parts)


def make_batch(seed: int, n: int = 6, noise: float = 0.3, empty: bool = False, extreme: bool = False):
    """Per-sample whole tensors: (train, rollout, masks, pg_loss, total_lengths, response_lengths); uneven
    lengths and prompts, multi-turn zeros in the masks, optionally an empty-mask sample and an extreme token."""
    g = torch.Generator().manual_seed(seed)
    resp = [int(x) for x in torch.randint(3, 14, (n,), generator=g)]
    prompts = [int(x) for x in torch.randint(1, 9, (n,), generator=g)]
    train = [-torch.rand(r, generator=g, dtype=torch.float64) * 3 for r in resp]
    rollout = [t + noise * torch.randn(t.shape, generator=g, dtype=torch.float64) for t in train]
    masks = [(torch.rand(r, generator=g) > 0.15).double() for r in resp]
    for m in masks:
        m[0] = 1.0
    if empty:
        masks[1] = torch.zeros_like(masks[1])
    if extreme:
        rollout[2][0] = train[2][0] + 15.0  # lr = -15 < log 1e-4 at a masked token: vetoed
    pg = [torch.randn(r, generator=g, dtype=torch.float64) for r in resp]
    totals = [p + r for p, r in zip(prompts, resp, strict=True)]
    return train, rollout, masks, pg, totals, resp
