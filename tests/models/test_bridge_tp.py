"""TP=2, then PP=2, in one spawned launch (2 gloo processes).

TP=2: HF -> Megatron (shards scattered by mbridge) -> HF (shards gathered), for every tiny case: full-vocabulary
logits equal to HF's in fp32, weights bitwise, a checkpoint written by rank 0 that HF loads with the same logits,
teacher-forced log-probs of HF-sampled tokens; a model whose heads do not divide over TP is refused on every rank
before any collective.

PP=2 (each stage half of the layers; a tied model's output layer on the last stage loads the embedding): every tiny
case and the tiny Qwen3-MoE give HF's logits through Megatron's pipeline schedule, on padded and packed (THD)
rows, and export HF's weights bitwise from either stage."""

from __future__ import annotations

import pytest
import torch

from slime_corr.mcore.parallel_groups import destroy_model_parallel_groups
from slime_corr.models.tiny_moe import TinyMoEArgs, make_tiny_moe_checkpoint
from tests.mcore.mcore_helpers import checking, spawn
from tests.models.models_helpers import CASES, V, make_tiny_checkpoint

pytestmark = pytest.mark.cost(30)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)
IDS = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(3))


def _tp2_worker(rank: int, world: int, root: str) -> None:
    from pathlib import Path

    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from slime_corr.models import CheckpointError, MegatronHFBridge, build_gpt_from_hf, load_hf_causal_lm
    from slime_corr.models.check import max_logit_diff, round_trip_mismatches, sample_and_rescore

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    for case in CASES:
        checking(f"TP=2 {case}")
        d = Path(root) / case
        model, bridge = build_gpt_from_hf(d, ddp=True)
        hf = load_hf_causal_lm(d)
        diff = max_logit_diff(model, hf, IDS)
        if rank == 0:
            print(f"{case} TP=2: max |logits - hf eager| = {diff:.3e}")
        assert diff <= 1e-5, (case, rank, diff)
        assert round_trip_mismatches(bridge, model) == [], (case, rank)
        out = bridge.save_hf_checkpoint(model, Path(root) / f"{case}_out")  # returns once rank 0 has written it
        with torch.no_grad():
            assert torch.equal(load_hf_causal_lm(out)(IDS).logits, hf(IDS).logits), (case, rank)
        r = sample_and_rescore(model, hf, IDS[0, :6].tolist(), max_new_tokens=8, temperature=0.7)
        gap = (r.megatron_teacher_forced - r.hf_teacher_forced).abs().max().item()
        assert gap <= 1e-5, (case, rank, gap)

    try:  # 4 heads, 2 KV groups: fits TP=2; this one has 3 KV groups
        MegatronHFBridge(Path(root) / "kv3")
    except CheckpointError as e:
        assert "--tensor-model-parallel-size=2" in str(e) and "num_key_value_heads=3" in str(e), e
    else:
        raise AssertionError("3 KV heads were accepted at TP=2")
    destroy_model_parallel_groups()
    _pp2(rank, [*CASES, "moe"], root)


def _pp2(rank: int, cases: list[str], root: str) -> None:
    from pathlib import Path

    from megatron.core import parallel_state as ps

    from slime_corr.layout.micro_batch import build_micro_batch
    from slime_corr.mcore.context_parallel import ParallelGroups
    from slime_corr.mcore.loss_hook import default_model_forward
    from slime_corr.mcore.pipeline import forward_only
    from slime_corr.models import build_gpt_from_hf, load_hf_causal_lm
    from slime_corr.models.check import round_trip_mismatches
    from slime_corr.samples import Sample

    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    groups = ParallelGroups.from_parallel_state()
    rows = [IDS[0, :13].tolist(), IDS[1, :20].tolist()]
    samples = [Sample(prompt_tokens=r[:4], response_tokens=r[4:], rollout_log_probs=[0.0] * (len(r) - 4),
                      loss_mask=[1] * (len(r) - 4)) for r in rows]
    batches = [build_micro_batch(samples), build_micro_batch(samples, packed=True, pad_to_multiple=4)]
    for case in cases:
        checking(f"PP=2 {case}")
        d = Path(root) / case
        model, bridge = build_gpt_from_hf(d, ddp=True)
        assert round_trip_mismatches(bridge, model) == [], (case, rank)  # every weight, from both stages
        hf = load_hf_causal_lm(d)
        logits = forward_only(model, batches, default_model_forward, lambda b, out: out, groups)
        if not ps.is_pipeline_last_stage():
            assert logits == []
            continue
        padded, packed = logits
        starts = batches[1]["cu_seqlens_padded"].tolist()
        with torch.no_grad():
            for i, r in enumerate(rows):
                ref = hf(input_ids=torch.tensor([r]), use_cache=False).logits[0]
                gaps = ((padded[i, :len(r)] - ref).abs().max().item(),
                        (packed[0, starts[i]:starts[i] + len(r)] - ref).abs().max().item())
                print(f"{case} PP=2 sample {i}: max |logits - hf eager| padded {gaps[0]:.2e}, packed {gaps[1]:.2e}")
                assert max(gaps) <= 1e-5, (case, i, gaps)


def test_tp2_conversion_matrix(tiny_dirs, tmp_path):
    import shutil

    for case, d in tiny_dirs.items():
        shutil.copytree(d, tmp_path / case)
    make_tiny_checkpoint(tmp_path / "kv3", "llama", num_attention_heads=6, num_key_value_heads=3, hidden_size=48)
    make_tiny_moe_checkpoint(tmp_path / "moe", TinyMoEArgs(vocab_size=V))
    spawn(_tp2_worker, 2, str(tmp_path))
