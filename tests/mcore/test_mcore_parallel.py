"""Every preset under (TP, CP, DP, PP) factorizations of gloo processes, through the REAL Megatron schedule
(`get_forward_backward_func`: no pipelining, or 1F1B over gloo p2p), Megatron DDP and `finalize_model_grads`,
equals a single-rank full-tensor reference: loss, IS weights, masks, step metrics and gradients, for every preset
and the example custom weighting function (`--custom-tis-function-path`), and the KL / entropy loss terms (reference
log-probs in the batch), with padded micro-batches and with
packed (THD) ones — the same sequences with uneven lengths, an empty and a length-1 one, per-sequence padding to
2·CP and Megatron's per-sample CP partition. Layouts (TP, CP, DP, PP): 1x1x1x1 (in this process); TP=2, CP=2,
DP=2, PP=2 alone (2 processes); DP=4, TP=2×DP=2, CP=2×DP=2, CP=4, TP=2×CP=2, TP=4 (4 processes, in test_mcore_parallel_world4.py); packed at
PACKED_LAYOUTS (the issue's list). Each case also checks the loss's CP/DP communication (padded and packed: ONE
CP all_reduce of per-sequence sums per micro-batch).

The "model" is the step's logits as one parameter (vocab-sharded over TP, replicated over DP/CP): each rank
reads its DP rows and CP zig-zag positions (packed: the positions its sequences were packed from), so the
gradient Megatron finalizes is exactly d loss / d logits. Under PP=2 the logits are the first stage's parameter,
sent on as activations, and the last stage adds a zero bias (its gradient: d loss / d logits summed). The
reference uses torch.log_softmax on the full logits (independent of the vocab-parallel code) and the correction
core without process groups.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from slime_corr.config import PRESETS, RolloutCorrectionConfig
from slime_corr.correction import compute_rollout_correction
from slime_corr.correction.quantiles import LEVEL1_BINS
from slime_corr.layout.context_parallel import slice_micro_batch_for_cp, zigzag_slice
from slime_corr.layout.micro_batch import BATCH_KEYS
from slime_corr.loss_terms import LossTermsConfig
from slime_corr.mcore.compat import get_batch_on_this_cp_rank
from slime_corr.mcore.context_parallel import ParallelGroups, slice_batch_for_cp
from slime_corr.mcore.logprobs import vocab_parallel_log_probs
from slime_corr.mcore.loss_hook import RolloutCorrectionLoss
from tests.mcore.mcore_helpers import (
    B_GLOBAL,
    N_MB,
    TEMPERATURE,
    S,
    V,
    assert_metrics_close,
    checking,
    full_logits,
    init_layout,
    local_rows,
    run_in_process,
    spawn,
    step_data,
)

pytestmark = pytest.mark.cost(50)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)

SEQ_MODES = ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
CUSTOM_FN = f"{Path(__file__).resolve().parents[2] / 'examples' / 'custom_tis.py'}:length_aware_geometric_is"
# (TP, CP, DP, PP) layouts per world size
LAYOUTS = {
    1: ((1, 1, 1, 1),),
    2: ((2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2)),
    4: ((1, 1, 4, 1), (2, 1, 2, 1), (1, 2, 2, 1), (1, 4, 1, 1), (2, 2, 1, 1), (4, 1, 1, 1)),
}
PACKED_LAYOUTS = {(1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2), (2, 2, 1, 1), (1, 2, 2, 1)}


def cases() -> list[tuple[str, RolloutCorrectionConfig, dict]]:
    """(tag, config, hook options): every preset with token-mean and one seq-mean mode, plus the example
    `--custom-tis-function-path` function; every other case runs chunked log-probs (chunk_size=13: each layout's
    micro-batch of 16 tokens or more spans two chunks or more, and chunks straddle rows of 16, 8 or 4 tokens) and logs
    the entropy."""
    out = []
    for i, name in enumerate(PRESETS):
        for mode in ("token-mean", SEQ_MODES[i % len(SEQ_MODES)]):
            out.append((f"{name}/{mode}", RolloutCorrectionConfig.preset(name, loss_agg_mode=mode)))
    custom = RolloutCorrectionConfig(use_tis=True, tis_upper_bound=2.0, custom_tis_function_path=CUSTOM_FN,
                                     loss_agg_mode="seq-mean-token-mean")
    out.append(("custom_tis_function/seq-mean-token-mean", custom))
    # --tis-batch-normalize over a step of N_MB micro-batches: the pre-pass uses lp_old (decoupled) or a
    # forward-only pass (bypass)
    out.append(("decoupled_token_is+normalize/token-mean",
                RolloutCorrectionConfig.preset("decoupled_token_is", tis_batch_normalize=True)))
    out.append(("pg_is+normalize/seq-mean-token-mean",
                RolloutCorrectionConfig.preset("pg_is", tis_batch_normalize=True, loss_agg_mode="seq-mean-token-mean")))
    # --rs-divergence-budget / --tis-ess-target: ONE bound per step (the reference's whole-step batch gives it),
    # from lp_old (decoupled) or the forward-only pre-pass (bypass)
    out.append(("decoupled+k3_mean_budget+ess/token-mean",
                RolloutCorrectionConfig(use_tis=True, tis_ess_target=0.9, rs_metric="k3", rs_agg="mean",
                                        rs_divergence_budget=0.02)))
    out.append(("pg_is+k2_token_budget+ess/seq-mean-token-mean",
                RolloutCorrectionConfig.preset("pg_is", tis_level="token", tis_upper_bound=None, tis_ess_target=0.97,
                                               rs_metric="k2", rs_agg="token", rs_divergence_budget=0.02,
                                               loss_agg_mode="seq-mean-token-mean")))
    out.append(("decoupled_seq_is_rs+kl+entropy/seq-mean-token-mean",
                RolloutCorrectionConfig.preset("decoupled_seq_is_rs", loss_agg_mode="seq-mean-token-mean")))
    # the KL term's reference log-probs come with the batch (as after the forward-only pass): the reference model
    # is never run here
    terms = dict(loss_terms=LossTermsConfig(kl_loss_coef=0.1, kl_loss_type="k3", entropy_coef=0.01),
                 ref_model=torch.nn.Module())
    # the batches hold a rollout log-prob raised by 12 (the veto's catastrophic token): above 0, an impossible
    # value the hook would stop on; --warn-invalid-inputs lets it through (counted, warned)
    return [(tag, cfg.replace(warn_invalid_inputs=True), dict(chunk_size=13 if i % 2 else 4096,
                                                              compute_entropy=i % 2 == 1,
                                                              **(terms if "+kl" in tag else {})))
            for i, (tag, cfg) in enumerate(out)]


def reference(cfg: RolloutCorrectionConfig, opts: dict, data: list[dict], logits: torch.Tensor):
    """Single rank, full tensors, the whole step as ONE [N_MB·B, S] batch: its loss and gradient wrt the logits,
    its correction (micro-batch k = rows k·B..(k+1)·B) and the step metrics. Only a custom weighting function's
    own metrics are the mean of per-micro-batch values, as the hook documents."""
    from slime_corr.correction.rejection_outcomes import rejection_outcome_pairs
    from slime_corr.losses import compute_policy_loss

    step = {k: torch.cat([b[k] for b in data]) for k in data[0]}
    leaf = logits.clone().requires_grad_()
    logp = torch.log_softmax(leaf.reshape(-1, S, V) / TEMPERATURE, dim=-1)
    lp = logp.gather(-1, step["labels"].unsqueeze(-1)).squeeze(-1)
    old = None if cfg.use_rollout_logprobs else step["old_log_probs"]
    entropy = -(logp.exp() * logp).sum(-1)
    terms = opts.get("loss_terms")
    out = compute_policy_loss(lp, old, step["rollout_log_probs"], step["advantages"], step["loss_mask"], cfg,
                              loss_terms=terms, ref_log_probs=step["ref_log_probs"], entropy=entropy)
    out.loss.backward()
    metrics = {k: v.item() for k, v in out.metrics.items()}
    metrics.update(loss=out.loss.item(), loss_denominator=out.denominator.item())
    in_mask = out.correction.loss_mask if cfg.use_rollout_correction else step["loss_mask"]
    metrics["pg_nonfinite_token_fraction"] = metrics["pg_nonfinite_token_count"] / max(1, (in_mask > 0).sum().item())
    metrics["pg_nonfinite_advantage_fraction"] = (metrics["pg_nonfinite_advantage_count"]
                                                  / max(1, (step["loss_mask"] > 0).sum().item()))
    if out.correction is not None and cfg.rejects:  # checked against a loop in tests/correction
        pairs = rejection_outcome_pairs(step["loss_mask"], out.correction.loss_mask, step["advantages"],
                                        step.get("rewards"))
        metrics.update({k: (v[0] / v[1]).item() for k, v in pairs.items()})
    if opts["compute_entropy"] or terms is not None:
        metrics["entropy"] = entropy.detach()[step["loss_mask"] > 0].mean().item()
    if out.correction is not None:
        lp_train = lp.detach() if cfg.use_rollout_logprobs else step["old_log_probs"]
        per_mb = [compute_rollout_correction(lp_train[rows], step["rollout_log_probs"][rows], step["loss_mask"][rows],
                                             cfg).function_metrics for rows in _mb_rows()]
        for key in out.correction.function_metrics:
            metrics[key] = sum(m[key].item() for m in per_mb) / N_MB
    return out.loss.detach(), leaf.grad, out.correction, metrics


def _mb_rows() -> list[slice]:
    return [slice(k * B_GLOBAL, (k + 1) * B_GLOBAL) for k in range(N_MB)]


def check_reference_is_not_trivial(tag: str, cfg: RolloutCorrectionConfig, ref: tuple) -> None:
    """The data must exercise every preset: a non-zero gradient, IS weights both truncated and below the
    bound, and rejection that keeps some sequences."""
    _, grad, correction, metrics = ref
    assert grad.abs().sum() > 0, f"{tag}: zero reference gradient"
    if cfg.use_tis and not cfg.custom_tis_function_path:
        w = correction.weights[correction.loss_mask > 0]
        upper = cfg.tis_bounds[1]
        if cfg.tis_batch_normalize:  # weights are divided by a step mean that is not 1
            assert abs(metrics["mis_batch_norm_factor"] - 1) > 1e-3, f"{tag}: {metrics['mis_batch_norm_factor']}"
            w = w * metrics["mis_batch_norm_factor"]
        if cfg.rejects_divergence:  # the divergence filter keeps only tokens whose weights are near 1: it must act
            assert metrics["mis_div_rejected_token_fraction"] > 0, f"{tag}: the divergence filter rejected nothing"
        else:
            assert ((w > 0) & (w < upper) & ((w - 1).abs() > 0.02)).any(), f"{tag}: weights {w}"
        assert cfg.use_rs or cfg.rejects_divergence or torch.isclose(w, torch.tensor(upper, dtype=w.dtype)).any(), \
            f"{tag}: none truncated {w}"
    if cfg.use_rs or cfg.rs_veto_threshold is not None or cfg.custom_tis_function_path:
        assert 0 < metrics["mis_rejected_seq_fraction"] < 1, f"{tag}: {metrics['mis_rejected_seq_fraction']}"
    if cfg.rs_veto_threshold is not None:
        assert metrics["mis_catastrophic_seq_fraction"] > 0, tag
    if "kl_loss" in metrics:  # the reference policy differs from the trained one: the KL term acts
        assert metrics["kl_loss"] > 1e-3, f"{tag}: {metrics['kl_loss']}"


def record_collectives(fn) -> list[tuple[str, object, tuple]]:
    """Run `fn()` and return every torch.distributed collective it issued: (name, group, tensor shape)."""
    names = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
             "all_to_all", "gather", "scatter", "reduce")
    calls: list[tuple[str, object, tuple]] = []
    real = {n: getattr(dist, n) for n in names}

    def wrap(name):
        def call(tensor, *args, **kwargs):
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else ("list",)
            calls.append((name, kwargs.get("group"), shape))
            return real[name](tensor, *args, **kwargs)

        return call

    try:
        for n in names:
            setattr(dist, n, wrap(n))
        fn()
    finally:
        for n, f in real.items():
            setattr(dist, n, f)
    return calls


def check_sequence_reduction(tag: str, cfg: RolloutCorrectionConfig, opts: dict, groups: ParallelGroups,
                             tp: int, b_local: int, packed: bool = False) -> None:
    """One micro-batch's CP/DP communication: only all_reduce (no gather of log-prob tensors); exactly one
    [n, k] CP all_reduce of per-sequence sums (a custom weighting function adds one for its mask's counts); the
    same number of CP/DP bytes whatever the sequence length. `packed`: the n sequences as one packed row (local
    spans of different lengths, one sequence without a valid token)."""
    g = torch.Generator().manual_seed(7)
    traffic = {}
    for s_local in (8, 32):
        valid = torch.tensor([s_local, 3, 0, 5][:b_local])
        if packed:
            spans = torch.tensor([s_local, 4, 2, 6][:b_local])  # local spans: the padded lengths / CP
            pos = torch.cat([torch.arange(n) for n in spans.tolist()])
            mask = (pos < valid.repeat_interleave(spans)).float().unsqueeze(0)
            cu = torch.cat([torch.zeros(1, dtype=torch.long), (spans * groups.cp_size).cumsum(0)]).int()
            extra = dict(cu_seqlens=cu, cu_seqlens_padded=cu)
        else:
            mask = (torch.arange(s_local)[None] < valid[:, None]).float()
            extra = {}
        shape = tuple(mask.shape)
        lp = -torch.rand(shape, generator=g, dtype=torch.float64) * mask
        batch = dict(labels=torch.randint(0, V, shape, generator=g), loss_mask=mask, rollout_log_probs=lp,
                     old_log_probs=lp * 0.9, ref_log_probs=lp * 1.1, advantages=mask.double(), **extra)
        logits = torch.randn(*shape, V // tp, generator=g, dtype=torch.float64, requires_grad=True)
        hook = RolloutCorrectionLoss(cfg, temperature=TEMPERATURE, seq_length_for_norm=S, **opts)
        calls = record_collectives(lambda hook=hook, batch=batch, logits=logits: hook.loss_func(batch, logits))
        assert {name for name, _, _ in calls} <= {"all_reduce"}, f"{tag}: {calls}"
        where = {id(groups.tp): "tp", id(groups.cp): "cp", id(groups.dp): "dp"}
        assert all(id(grp) in where for _, grp, _ in calls), f"{tag}: collective on an unexpected group"
        hist = [(where[id(grp)], shape) for _, grp, shape in calls if shape[-1:] == (LEVEL1_BINS,)]
        seq = [shape for _, grp, shape in calls if grp is groups.cp and len(shape) == 2 and shape[-1] != LEVEL1_BINS]
        # the correction's one per-sequence CP sum (a custom function's own second), and the reward-aware rejection
        # diagnostics' [n, 3] one with a correction that rejects (correction/rejection_outcomes.py)
        expected = 0 if groups.cp_size == 1 else (
            (2 if cfg.custom_tis_function_path else 1) + (1 if cfg.rejects else 0))
        assert len(seq) == expected and all(shape[0] == b_local for shape in seq), f"{tag}: {seq}"
        # a budget (one micro-batch: its own bound) adds its histogram SUM per group, nothing else
        budgets = (cfg.rs_divergence_budget is not None) + (cfg.tis_ess_target is not None)
        spread = (groups.cp_size > 1) + (groups.dp is not None and dist.get_world_size(groups.dp) > 1)
        assert len(hist) == budgets * spread, f"{tag}: {hist}"
        traffic[s_local] = [(where[id(grp)], shape) for _, grp, shape in calls if grp is not groups.tp]
    assert traffic[8] == traffic[32], f"{tag}: CP/DP traffic depends on the sequence length {traffic}"


class LazyStream:
    """Micro-batches as a stream (like `BufferMicroBatchIterator`): fails if micro-batch k is read before the
    forward of micro-batch k - 1 ran, i.e. if the schedule did not consume the stream lazily."""

    def __init__(self, batches: list[dict], forwards: list[int]) -> None:
        self.batches, self.forwards, self.pulled = batches, forwards, 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> LazyStream:
        return self

    def __next__(self) -> dict:
        if self.pulled == len(self.batches):
            raise StopIteration
        assert self.forwards == list(range(self.pulled)), f"read {self.pulled} after forwards {self.forwards}"
        self.pulled += 1
        return dict(self.batches[self.pulled - 1])


class LogitsModel(torch.nn.Module):
    """Stands in for a model: its parameter IS the logits [N_MB, B, S, V/TP] of the whole step. A micro-batch reads
    its DP rows and CP zig-zag positions, or, packed, the positions `row_index` / `col_index` it was packed from.
    As the first of two pipeline stages it sends [S, B, V/TP] activations on, as Megatron's stages do."""

    pre_process, share_embeddings_and_output_weights = True, False  # what finalize_model_grads reads under PP

    def __init__(self, config, logits_shard: torch.Tensor, dp_rank: int, dp: int, cp_rank: int, cp: int,
                 first_of_two: bool = False):
        super().__init__()
        from megatron.core.enums import ModelType

        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.logits = torch.nn.Parameter(logits_shard.clone())
        self.where = (dp_rank, dp, cp_rank, cp)
        self.first_of_two = first_of_two

    def forward(self, batch: dict) -> torch.Tensor:
        dp_rank, dp, cp_rank, cp = self.where
        rows = local_rows(self.logits[batch["mb_index"]], dp_rank, dp)
        if "row_index" in batch:  # packed: [1, T_local, V/TP]
            out = rows[batch["row_index"][0], batch["col_index"][0]].unsqueeze(0)
        else:
            out = zigzag_slice(rows, cp_rank, cp, dim=1)
        return out.transpose(0, 1).contiguous() if self.first_of_two else out

    def set_input_tensor(self, tensor) -> None:  # Megatron's schedule calls this on the model
        pass


class BiasStage(torch.nn.Module):
    """The last of two pipeline stages: logits = the received activations + a bias [V/TP] (zero: the reference's
    logits), whose gradient is d loss / d logits summed over every position."""

    pre_process, share_embeddings_and_output_weights = False, False

    def __init__(self, config, vocab_shard: int):
        super().__init__()
        from megatron.core.enums import ModelType

        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.bias = torch.nn.Parameter(torch.zeros(vocab_shard, dtype=torch.float64))
        self.received: torch.Tensor | None = None

    def set_input_tensor(self, tensor) -> None:
        self.received = tensor[0] if isinstance(tensor, list) else tensor

    def forward(self, batch: dict) -> torch.Tensor:
        return self.received.transpose(0, 1) + self.bias


def packed_rows(batch: dict[str, torch.Tensor], cp: int) -> dict[str, torch.Tensor]:
    """The rows of a padded [B, S] micro-batch as one packed row (the test's own packing, not batching's): row i's
    first L_i positions (L_i = its last masked position + 1: uneven, an empty and a length-1 sequence in the
    step data), padded to a multiple of 2·CP with the row's next (masked) positions; `row_index` / `col_index`
    record where each packed position comes from."""
    mask = batch["loss_mask"] > 0
    pos = torch.arange(mask.shape[1])
    lengths = torch.where(mask, pos + 1, 0).amax(1).tolist()
    spans = [-(-n // (2 * cp)) * 2 * cp if cp > 1 else n for n in lengths]
    rows = torch.cat([torch.full((p,), i) for i, p in enumerate(spans)]).long()
    cols = torch.cat([torch.arange(p) for p in spans]).long()
    out = {k: v[rows, cols].unsqueeze(0) for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() == 2}
    out.update(row_index=rows.unsqueeze(0), col_index=cols.unsqueeze(0),
               cu_seqlens=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32),
               cu_seqlens_padded=torch.tensor([0, *torch.tensor(spans).cumsum(0).tolist()], dtype=torch.int32))
    return out


def _local_batches(data, dp_rank, dp, groups, packed: bool):
    out = []
    for k, b in enumerate(data):
        rows = {key: local_rows(v, dp_rank, dp) for key, v in b.items()}
        if packed:
            packed_batch = packed_rows(rows, groups.cp_size)
            local = slice_batch_for_cp(packed_batch, groups)
            index = slice_micro_batch_for_cp(packed_batch, groups.cp_rank, groups.cp_size,
                                             keys=("row_index", "col_index"))
            local.update(row_index=index["row_index"], col_index=index["col_index"])
        else:
            local = slice_batch_for_cp(rows, groups)
        local["mb_index"] = k
        out.append(local)
    return out


def check_megatron_cp_slicing(data, dp_rank, dp, groups, tag) -> None:
    """The CP layout is Megatron's own: padded rows as `get_batch_on_this_cp_rank` slices them, and a packed
    row sample by sample as `get_thd_batch_on_this_cp_rank` partitions it (TE's thd_get_partitioned_indices, CUDA
    only: here Megatron's zig-zag of each sample's padded span, which is what that partition is)."""
    rows = {k: local_rows(v, dp_rank, dp) for k, v in data[0].items()}
    megatron_slice = get_batch_on_this_cp_rank(dict(rows))
    for k, v in slice_batch_for_cp(rows, groups).items():
        assert torch.equal(v, megatron_slice[k]), f"{tag}: {k} sliced differently"
    packed = packed_rows(rows, groups.cp_size)
    mine = slice_batch_for_cp(packed, groups)
    starts = packed["cu_seqlens_padded"].tolist()
    for k in BATCH_KEYS:
        want = [packed[k][:, :0]] + [get_batch_on_this_cp_rank({k: packed[k][:, a:b].clone()})[k]
                                     for a, b in zip(starts, starts[1:], strict=False) if b > a]
        assert torch.equal(mine[k], torch.cat(want, 1)), f"{tag}: packed {k} partitioned differently"


def communication_checked(world: int) -> set[str]:
    """The cases whose one-micro-batch communication `check_sequence_reduction` counts under each layout: every case
    at one and two processes (each parallel dimension alone); at four (the dimensions combined), the first case of
    each expectation it asserts (a custom weighting function, rejection, budgets) and of each loss aggregation and
    chunking: the other cases' counts are those of their class, and each of them is counted under the two-process
    layouts. Every case still trains a whole step under every layout."""
    if world < 4:
        return {name for name, _, _ in cases()}
    first: dict[tuple, str] = {}
    for name, cfg, opts in cases():
        expectation = (bool(cfg.custom_tis_function_path), cfg.rejects,
                       cfg.rs_divergence_budget is not None, cfg.tis_ess_target is not None,
                       cfg.loss_agg_mode == "token-mean", opts.get("chunk_size"))
        first.setdefault(expectation, name)
    return set(first.values())


def _worker(rank: int, world: int) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.transformer import TransformerConfig

    logits = full_logits()
    data = step_data(seed=1, logits=logits)
    refs = {}
    counted = communication_checked(world)
    for name, cfg, opts in cases():
        checking(f"the one-rank reference of {name}")
        refs[name] = reference(cfg, opts, data, logits)
        check_reference_is_not_trivial(name, cfg, refs[name])
    for tp, cp, dp, pp in LAYOUTS[world]:
        init_layout(tp, cp, pp)
        groups = ParallelGroups.from_parallel_state()
        tp_rank, cp_rank = ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank()
        dp_rank = ps.get_data_parallel_rank()
        layout = f"TP={tp} CP={cp} DP={dp} PP={pp}"
        checking(layout)
        assert (ps.get_tensor_model_parallel_world_size(), groups.cp_size, ps.get_data_parallel_world_size(),
                groups.pp_size) == (tp, cp, dp, pp), layout
        last = groups.pp_last
        vshard = slice(tp_rank * V // tp, (tp_rank + 1) * V // tp)
        check_megatron_cp_slicing(data, dp_rank, dp, groups, layout)
        check_vocab_parallel_log_probs(logits, dp_rank, dp, groups, vshard, tp)

        for packed in (False, True) if (tp, cp, dp, pp) in PACKED_LAYOUTS else (False,):
            batches = _local_batches(data, dp_rank, dp, groups, packed)
            for name, cfg, opts in cases():
                tag = f"{layout} {'packed' if packed else 'padded'} {name} {opts}"
                checking(tag)
                ref_loss, ref_grad, ref_corr, ref_metrics = refs[name]
                if not packed and name in counted:
                    check_sequence_reduction(tag, cfg, opts, groups, tp, batches[0]["labels"].shape[0])
                    check_sequence_reduction(tag, cfg, opts, groups, tp, batches[0]["labels"].shape[0], packed=True)
                tcfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4,
                                         tensor_model_parallel_size=tp, context_parallel_size=cp,
                                         pipeline_model_parallel_size=pp, pipeline_dtype=torch.float64,
                                         calculate_per_token_loss=True, use_cpu_initialization=True,
                                         params_dtype=torch.float64)
                tcfg.finalize_model_grads_func = finalize_model_grads
                tcfg.variable_seq_lengths = True  # packed micro-batches differ in length (set as slime does)
                if ps.is_pipeline_first_stage(ignore_virtual=True):
                    module = LogitsModel(tcfg, logits[..., vshard], dp_rank, dp, cp_rank, cp, first_of_two=pp > 1)
                else:
                    module = BiasStage(tcfg, V // tp)
                model = DistributedDataParallel(tcfg, DistributedDataParallelConfig(), module=module)
                forwards: list[int] = []
                hook = RolloutCorrectionLoss(cfg, temperature=TEMPERATURE, keep_outputs=True, seq_length_for_norm=S,
                                             model_forward=lambda m, b, f=forwards: f.append(b["mb_index"]) or m(b),
                                             **opts)
                # decoupled presets: lp_old is given in the batch (as if recomputed), so skip the recompute pass;
                # single-pass modes read the micro-batches as a stream, as from the rollout's buffer
                step_batches = LazyStream(batches, forwards) if hook.can_stream(N_MB) else [dict(b) for b in batches]
                metrics = hook.train_step(model, step_batches, recompute_old_log_probs=False)
                assert not isinstance(step_batches, LazyStream) or step_batches.pulled == N_MB, tag
                if pp > 1 and not last:  # the loss and its metrics are on the last stage
                    assert metrics == {} and not hook.outputs, tag
                    check_gradients(tag, model.module.logits, ref_grad[..., vshard])
                    continue
                if pp > 1:  # the bias stage sums d loss / d logits over every position
                    check_gradients(tag, model.module.bias, ref_grad[..., vshard].sum((0, 1, 2)))
                else:
                    check_gradients(tag, model.module.logits, ref_grad[..., vshard])
                torch.testing.assert_close(torch.tensor(metrics["loss"], dtype=torch.float64), ref_loss,
                                           rtol=1e-6, atol=1e-12, msg=tag)
                assert_metrics_close(metrics, ref_metrics, tag)
                check_corrections(tag, hook.outputs, ref_corr, batches, dp_rank, dp, cp_rank, cp, packed)


def check_vocab_parallel_log_probs(logits, dp_rank, dp, groups, vshard, tp) -> None:
    """Vocab-parallel log-probs + entropy, chunked, forward and backward: equal to torch on the full vocab and
    bitwise equal on every TP rank."""
    lg = zigzag_slice(local_rows(logits[0], dp_rank, dp), groups.cp_rank, groups.cp_size, dim=1)
    labels = zigzag_slice(local_rows(step_data(seed=1, logits=logits)[0]["labels"], dp_rank, dp), groups.cp_rank,
                          groups.cp_size, dim=1)
    shard = lg[..., vshard].clone().requires_grad_()
    lp, ent = vocab_parallel_log_probs(shard, labels, tp_group=groups.tp, temperature=TEMPERATURE,
                                       chunk_size=7, with_entropy=True)
    full = lg.clone().requires_grad_()
    ref_logp = torch.log_softmax(full / TEMPERATURE, -1)
    ref_lp, ref_ent = ref_logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(ref_logp.exp() * ref_logp).sum(-1)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-12, atol=1e-12)
    coef = torch.randn((2, *labels.shape), generator=torch.Generator().manual_seed(3), dtype=lp.dtype)
    (coef[0] * lp + coef[1] * ent).sum().backward()
    (coef[0] * ref_lp + coef[1] * ref_ent).sum().backward()
    torch.testing.assert_close(shard.grad, full.grad[..., vshard], rtol=1e-10, atol=1e-12)
    for t in (lp, ent):
        gathered = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(gathered, t.detach(), group=groups.tp)
        assert all(torch.equal(g, t) for g in gathered), "log-probs/entropy differ across TP ranks"


def check_gradients(tag: str, param: torch.nn.Parameter, ref_grad: torch.Tensor) -> None:
    """The gradient Megatron finalized (DDP's main_grad, reduced over DP×CP) equals the reference's."""
    torch.testing.assert_close(param.main_grad, ref_grad, rtol=1e-6, atol=1e-12, msg=tag)


def check_corrections(tag, outputs, ref_corr, batches, dp_rank, dp, cp_rank, cp, packed) -> None:
    """Every micro-batch's weights and final mask equal the reference's at this rank's positions."""
    assert len(outputs) == N_MB, tag
    for rows, out, batch in zip(_mb_rows(), outputs, batches, strict=True):
        if ref_corr is None:
            assert out.correction is None, tag
            continue

        def local(t, rows=rows, batch=batch):
            mine = local_rows(t[rows], dp_rank, dp)
            if packed:
                return mine[batch["row_index"][0], batch["col_index"][0]].unsqueeze(0)
            return zigzag_slice(mine, cp_rank, cp, dim=1)

        assert torch.equal(out.correction.loss_mask, local(ref_corr.loss_mask)), tag
        assert (out.correction.weights is None) == (ref_corr.weights is None), tag
        if ref_corr.weights is not None:
            torch.testing.assert_close(out.correction.weights, local(ref_corr.weights), rtol=1e-6, atol=1e-12,
                                       msg=tag)


@pytest.mark.parametrize("world", [2])  # 4 processes: test_mcore_parallel_world4.py
def test_presets_under_tp_cp_dp_pp_padded_and_packed_match_single_rank_reference(world):
    spawn(_worker, world)


def test_presets_on_one_rank_padded_and_packed_match_the_reference():
    """The 1x1x1x1 layout: one gloo rank in this process (no spawn), Megatron's real schedule and DDP."""
    run_in_process(_worker)
