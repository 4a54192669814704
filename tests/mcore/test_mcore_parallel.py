"""Every preset under (TP, CP, DP) factorizations of 4 gloo processes, through the REAL Megatron schedule
(`get_forward_backward_func`), Megatron DDP and `finalize_model_grads`, equals a single-rank full-tensor
reference: loss, IS weights, masks, step metrics and gradients.

The "model" is the step's logits as one parameter (vocab-sharded over TP, replicated over DP/CP): each rank
reads its DP rows and CP zig-zag positions, so the gradient Megatron finalizes is exactly d loss / d logits.
The reference uses torch.log_softmax on the full logits (independent of the vocab-parallel code) and the
correction core without process groups.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from mcore_helpers import (
    LAYOUTS_4,
    N_MB,
    TEMPERATURE,
    V,
    assert_metrics_close,
    full_logits,
    init_layout,
    local_rows,
    spawn,
    step_data,
)

from slime_corr.config import PRESETS, RolloutCorrectionConfig
from slime_corr.mcore.context_parallel import ParallelGroups, slice_batch_for_cp, zigzag_slice
from slime_corr.mcore.logprobs import vocab_parallel_log_probs
from slime_corr.mcore.loss_hook import RolloutCorrectionLoss

SEQ_MODES = ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def cases() -> list[RolloutCorrectionConfig]:
    out = []
    for i, name in enumerate(PRESETS):
        for mode in ("token-mean", SEQ_MODES[i % len(SEQ_MODES)]):
            out.append(RolloutCorrectionConfig.preset(name, loss_agg_mode=mode))
    return out


def reference(cfg: RolloutCorrectionConfig, data: list[dict], logits: torch.Tensor):
    """Single rank, full tensors: Σ_k loss_sum_k / Σ_k count_k and its gradient wrt the logits."""
    from slime_corr.losses import compute_policy_loss

    leaf = logits.clone().requires_grad_()
    sums, dens, outs = [], [], []
    for k, b in enumerate(data):
        lp = torch.log_softmax(leaf[k] / TEMPERATURE, dim=-1).gather(-1, b["labels"].unsqueeze(-1)).squeeze(-1)
        old = None if cfg.use_rollout_logprobs else b["old_log_probs"]
        out = compute_policy_loss(lp, old, b["rollout_log_probs"], b["advantages"], b["loss_mask"], cfg)
        sums.append(out.loss_sum)
        dens.append(out.denominator)
        outs.append(out)
    loss = sum(sums) / torch.stack(dens).sum().clamp_min(1)
    loss.backward()
    hook = RolloutCorrectionLoss(cfg, temperature=TEMPERATURE, groups=ParallelGroups())
    metrics = hook.reduce_step_metrics([hook.loss_func(b, logits[k])[2] for k, b in enumerate(data)])
    return loss.detach(), leaf.grad, outs, metrics


class LogitsModel(torch.nn.Module):
    """Stands in for a model: its parameter IS the logits [N_MB, B, S, V/TP] of the whole step."""

    def __init__(self, config, logits_shard: torch.Tensor, dp_rank: int, dp: int, cp_rank: int, cp: int):
        super().__init__()
        from megatron.core.enums import ModelType

        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.logits = torch.nn.Parameter(logits_shard.clone())
        self.where = (dp_rank, dp, cp_rank, cp)

    def forward(self, mb_index: int) -> torch.Tensor:
        dp_rank, dp, cp_rank, cp = self.where
        return zigzag_slice(local_rows(self.logits[mb_index], dp_rank, dp), cp_rank, cp, dim=1)

    def set_input_tensor(self, tensor) -> None:  # Megatron's schedule calls this on the model
        pass


def _local_batches(data, dp_rank, dp, groups):
    out = []
    for k, b in enumerate(data):
        rows = {key: local_rows(v, dp_rank, dp) for key, v in b.items()}
        local = slice_batch_for_cp(rows, groups)
        local["mb_index"] = k
        out.append(local)
    return out


def _worker(rank: int, world: int) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.transformer import TransformerConfig

    data = step_data()
    logits = full_logits()
    refs = {}
    for cfg in cases():
        refs[(cfg.rollout_correction_preset, cfg.loss_agg_mode)] = reference(cfg, data, logits)
    for tp, cp, dp in LAYOUTS_4:
        init_layout(tp, cp)
        groups = ParallelGroups.from_parallel_state()
        tp_rank, cp_rank = ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank()
        dp_rank = ps.get_data_parallel_rank()
        assert ps.get_data_parallel_world_size() == dp
        vshard = slice(tp_rank * V // tp, (tp_rank + 1) * V // tp)
        batches = _local_batches(data, dp_rank, dp, groups)

        # vocab-parallel log-probs + entropy: equal to the full-vocab reference and bitwise equal on TP ranks
        lg = zigzag_slice(local_rows(logits[0], dp_rank, dp), cp_rank, cp, dim=1)
        lp, ent = vocab_parallel_log_probs(lg[..., vshard], batches[0]["labels"], tp_group=groups.tp,
                                           temperature=TEMPERATURE, chunk_size=7, with_entropy=True)
        full = torch.log_softmax(lg / TEMPERATURE, -1)
        torch.testing.assert_close(lp, full.gather(-1, batches[0]["labels"].unsqueeze(-1)).squeeze(-1))
        torch.testing.assert_close(ent, -(full.exp() * full).sum(-1))
        gathered = [torch.empty_like(lp) for _ in range(tp)]
        dist.all_gather(gathered, lp, group=groups.tp)
        assert all(torch.equal(g, lp) for g in gathered), "log-probs differ across TP ranks"

        for cfg in cases():
            key = (cfg.rollout_correction_preset, cfg.loss_agg_mode)
            tag = f"TP={tp} CP={cp} DP={dp} {key}"
            ref_loss, ref_grad, ref_outs, ref_metrics = refs[key]
            tcfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4,
                                     tensor_model_parallel_size=tp, context_parallel_size=cp,
                                     calculate_per_token_loss=True, use_cpu_initialization=True,
                                     params_dtype=torch.float64)
            tcfg.finalize_model_grads_func = finalize_model_grads
            model = DistributedDataParallel(
                tcfg, DistributedDataParallelConfig(), module=LogitsModel(tcfg, logits[..., vshard], dp_rank,
                                                                          dp, cp_rank, cp))
            hook = RolloutCorrectionLoss(cfg, temperature=TEMPERATURE, keep_outputs=True,
                                         model_forward=lambda m, b: m(b["mb_index"]))
            # decoupled presets: lp_old is given in the batch (as if recomputed), so skip the recompute pass
            metrics = hook.train_step(model, [dict(b) for b in batches], recompute_old_log_probs=False)
            grad = model.module.logits.main_grad
            torch.testing.assert_close(grad, ref_grad[..., vshard], rtol=1e-6, atol=1e-12, msg=tag)
            torch.testing.assert_close(torch.tensor(metrics["loss"], dtype=torch.float64), ref_loss,
                                       rtol=1e-6, atol=1e-12, msg=tag)
            assert_metrics_close(metrics, ref_metrics, tag)
            for k, out in enumerate(hook.outputs):
                ref = ref_outs[k].correction
                def sl(t, dp_rank=dp_rank, dp=dp, cp_rank=cp_rank, cp=cp):
                    return zigzag_slice(local_rows(t, dp_rank, dp), cp_rank, cp, dim=1)

                if ref is None:
                    assert out.correction is None, tag
                    continue
                assert torch.equal(out.correction.loss_mask, sl(ref.loss_mask)), tag
                if ref.weights is not None:
                    torch.testing.assert_close(out.correction.weights, sl(ref.weights), rtol=1e-6, atol=1e-12,
                                               msg=tag)
            assert len(hook.outputs) == N_MB
    ps.destroy_model_parallel()


def test_presets_under_tp_cp_dp_match_single_rank_reference():
    spawn(_worker, 4)
