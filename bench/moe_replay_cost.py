"""What routing replay costs the trainer on the tiny Qwen3-MoE (no engine; not part of the tests).

    python bench/moe_replay_cost.py [--batch 8] [--seq 64] [--repeats 15] [--markdown docs/benchmarks.md]

Times one training forward + backward of a padded micro-batch (fp32 Megatron model from the tiny MoE checkpoint,
`moe_enable_routing_replay=True`) three ways, interleaved, and prints the medians and their ratios to the plain
forward: plain (`default_model_forward`), `routed_forward(replay=False)` (the trainer's own routes captured, as
`--log-routing-mismatch`) and `routed_forward(replay=True)` (the engine's routes replayed and the router's own
choice recorded, as `--use-rollout-routing-replay`); the engine's routes are random top-k sets. Also prints the
bytes per token the routes take in a sample. `--markdown FILE` also writes the table into FILE between its markers
(block moe_replay_cost.py, bench/markdown_table.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from markdown_table import caption_line, write_block  # noqa: E402  # bench/markdown_table.py

LABELS = {"plain": "plain", "capture": "the trainer's own routes captured (`--log-routing-mismatch`)",
          "replay": "the engine's routes replayed (`--use-rollout-routing-replay`)"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--markdown", metavar="FILE", help="also write the table into FILE between its markers")
    a = p.parse_args()

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from slime_corr.layout.micro_batch import ROUTE_KEY
    from slime_corr.mcore.cpu_compat import apply_cpu_compat
    from slime_corr.mcore.loss_hook import default_model_forward
    from slime_corr.mcore.routing import routed_forward
    from slime_corr.models import build_gpt_from_hf
    from slime_corr.models.tiny_moe import TinyMoEArgs, make_tiny_moe_checkpoint
    from slime_corr.ports import init_world_of_one
    from slime_corr.routed_experts import RoutedExpertsSpec

    init_world_of_one("gloo")
    ps.initialize_model_parallel(1)
    apply_cpu_compat()
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    args = TinyMoEArgs()
    spec = RoutedExpertsSpec(args.num_hidden_layers, args.num_experts_per_tok, args.num_experts)
    with tempfile.TemporaryDirectory() as tmp:
        model, _ = build_gpt_from_hf(make_tiny_moe_checkpoint(tmp, args),
                                     config_overrides={"moe_enable_routing_replay": True})
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (a.batch, a.seq), generator=g)
    routes = torch.rand(a.batch, a.seq, spec.num_layers, spec.num_experts, generator=g).topk(spec.top_k, -1).indices
    batch = {"tokens": tokens, "position_ids": torch.arange(a.seq).expand(a.batch, -1), ROUTE_KEY: routes.to(spec.dtype)}
    ways = {"plain": default_model_forward, "capture": routed_forward(default_model_forward, replay=False),
            "replay": routed_forward(default_model_forward, replay=True)}
    times: dict[str, list[float]] = {k: [] for k in ways}
    for i in range(a.repeats + 2):
        for name, forward in ways.items():
            start = time.perf_counter()
            forward(model, dict(batch)).float().square().mean().backward()
            if i >= 2:  # warm-up
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["plain"])
    print(f"micro-batch {a.batch} x {a.seq} tokens, forward + backward, median of {a.repeats} (interleaved):")
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:8s} {med * 1e3:8.1f} ms  ratio to plain {med / base:.3f}")
        rows.append([LABELS[name], f"{med * 1e3:.1f}", f"{med / base:.3f}"])
    if a.markdown:
        caption = caption_line(sys.argv, "cpu", torch.get_num_threads(),
                               f"the tiny Qwen3-MoE (fp32 Megatron), a padded micro-batch of {a.batch} × {a.seq} "
                               f"tokens, forward + backward, interleaved medians of {a.repeats}; routes: "
                               f"{spec.bytes_per_token} bytes per token in a sample ({spec.dtype})")
        write_block(a.markdown, "moe_replay_cost.py", caption, ["forward + backward", "ms", "ratio to plain"], rows,
                    title="What routing replay costs the trainer (bench/moe_replay_cost.py)")
    print(f"routes: {spec.bytes_per_token} bytes per token in a sample ({spec.dtype}), "
          f"{4 * spec.num_layers * spec.top_k} as int32 on the wire before base64")
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
