"""From the rollout's buffer to Megatron's schedule with packed, token-balanced micro-batches (`--use-dynamic-
batch-size --max-tokens-per-gpu` behaviour): a step of GRPO groups streamed through `BufferMicroBatchIterator` with
a token budget (packed micro-batches of whole groups, an over-long group alone, empty micro-batches filling up to
`len()`) trains exactly like the same step in fixed-size padded micro-batches — loss, every step metric and the
gradient — through `RolloutCorrectionLoss.train_step`, Megatron's real schedule and DDP (one gloo rank in this
process), streamed (bypass) and materialized (decoupled lp_old recompute + step normalization).

The model maps each token to its logits through a table (position-wise, so packing cannot change a logit).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.rollout.buffer import SampleBuffer
from slime_corr.rollout.data_iterator import BufferMicroBatchIterator, background_event_loop
from slime_corr.samples import Sample, SampleStatus
from tests.mcore.mcore_helpers import checking, init_layout, run_in_process

V = 16
RESPONSES = [[5, 1], [2, 9], [14, 13], [1, 3], [4, 4], [7, 0]]  # per group of 2: an empty and a 1-token response
CASES = {
    "pg_is (streamed)": RolloutCorrectionConfig.preset("pg_is", loss_agg_mode="seq-mean-token-mean"),
    "decoupled_seq_is_rs+normalize (materialized)": RolloutCorrectionConfig.preset(
        "decoupled_seq_is_rs", tis_batch_normalize=True, rs_upper_bound=1.05, rs_lower_bound=0.95),
}


def _table() -> torch.Tensor:
    return torch.randn(V, V, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def _groups() -> list[list[Sample]]:
    """Rollout log-probs = the model's own (log_softmax of the table row of the previous token) + noise, so the
    correction keeps most sequences."""
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(_table(), -1)
    out = []
    for k, lengths in enumerate(RESPONSES):
        group = []
        for i, n in enumerate(lengths):
            s = Sample(prompt_tokens=[1, 2 + k], group_id=k, index=2 * k + i)
            if n:
                tokens = torch.randint(0, V, (n,), generator=g).tolist()
                prev = [2 + k, *tokens[:-1]]
                lps = logp[prev, tokens] + 0.05 * torch.randn(n, generator=g, dtype=torch.float64)
                s.append_segment(tokens, lps.clamp(max=0.0).float().tolist(), "v0")
            s.status, s.reward = SampleStatus.COMPLETED, float(torch.rand((), generator=g))
            group.append(s)
        out.append(group)
    return out


class TokenLogits(torch.nn.Module):
    """logits[t] = table[token t]: a position-wise stand-in for a model."""

    def __init__(self, config) -> None:
        super().__init__()
        from megatron.core.enums import ModelType

        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.table = torch.nn.Parameter(_table())

    def forward(self, batch: dict) -> torch.Tensor:
        return self.table[batch["tokens"]]

    def set_input_tensor(self, tensor) -> None:
        pass


def _step(cfg: RolloutCorrectionConfig, **iterator_options) -> tuple[dict[str, float], torch.Tensor, object]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.transformer import TransformerConfig

    from slime_corr.mcore.loss_hook import RolloutCorrectionLoss

    tcfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, calculate_per_token_loss=True,
                             use_cpu_initialization=True, params_dtype=torch.float64)
    tcfg.finalize_model_grads_func = finalize_model_grads
    model = DistributedDataParallel(tcfg, DistributedDataParallelConfig(), module=TokenLogits(tcfg))
    hook = RolloutCorrectionLoss(cfg, seq_length_for_norm=16, model_forward=lambda m, b: m(b))
    with background_event_loop() as loop:
        buffer = SampleBuffer(maxsize=4)

        async def rollout() -> None:
            for group in _groups():
                await buffer.put_group(group)

        produced = asyncio.run_coroutine_threadsafe(rollout(), loop)
        data = BufferMicroBatchIterator(buffer, loop, 2 * len(RESPONSES), 4, group_size=2, timeout=30,
                                        **iterator_options)
        metrics = hook.train_step(model, data if hook.can_stream(len(data)) else data.materialize())
        produced.result(timeout=30)
    return metrics, model.module.table.main_grad.clone(), data


def _worker(rank: int, world: int) -> None:
    init_layout(1, 1)
    for name, cfg in CASES.items():
        checking(name)
        padded, grad_padded, fixed = _step(cfg)
        packed, grad_packed, budget = _step(cfg, max_tokens_per_micro_batch=24)
        # the budget makes uneven micro-batches: two groups, one over-long group alone, ... then empty ones
        assert budget.oversized_groups == 1 and 0 in budget.batch_sizes and len(set(budget.batch_sizes)) > 2, (
            name, budget.batch_sizes)
        assert fixed.batch_sizes == [4, 4, 4], name
        assert set(packed) == set(padded), name
        for key, value in padded.items():
            assert packed[key] == pytest.approx(value, rel=1e-9, abs=1e-12), f"{name} {key}"
        assert padded["mis_valid_token_count"] > 0 and grad_padded.abs().sum() > 0, name
        assert not cfg.use_rs or 0 < padded["mis_rejected_seq_fraction"] < 1, name
        torch.testing.assert_close(grad_packed, grad_padded, rtol=1e-9, atol=1e-13, msg=name)


def test_token_budget_packed_step_equals_the_padded_step():
    run_in_process(_worker)
