"""Call slime_corr's slime hook as slime's `policy_loss_function` does (CPU, one process, no slime needed).

    python examples/slime/call_like_slime.py

slime's parser gives `args`; its `--custom-config-path` YAML is set on `args` key by key; `load_function` imports
`--custom-tis-function-path`; per sample, the train / rollout log-probs and the loss mask; `pg_loss` is the
concatenated per-token policy loss. slime then reduces `pg_loss` with the returned masks and each metric with the
original masks; here a per-sample token mean stands for its reducer.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import torch
import yaml

HOOK = "slime_corr.integrations.slime.compute_mis_weights_with_cp"


def main() -> None:
    args = argparse.Namespace(use_tis=True, tis_clip=2.0, tis_clip_low=0.0, get_mismatch_metrics=False,
                              use_rollout_logprobs=False, custom_tis_function_path=HOOK,
                              custom_config_path=str(Path(__file__).with_name("mis.yaml")))
    for key, value in yaml.safe_load(Path(args.custom_config_path).read_text()).items():
        setattr(args, key, value)  # what slime's parse_args does with the YAML
    module, _, name = HOOK.rpartition(".")
    tis_func = getattr(importlib.import_module(module), name)  # slime's load_function

    g = torch.Generator().manual_seed(0)
    response_lengths = [5, 8, 3, 6]
    total_lengths = [n + 4 for n in response_lengths]
    train = [-torch.rand(n, generator=g) for n in response_lengths]
    rollout = [t + 0.3 * torch.randn(n, generator=g) for t, n in zip(train, response_lengths, strict=True)]
    train[1][2] = rollout[1][2] - 12.0  # ratio e^-12 < 1e-4 at one token: the veto rejects sequence 1
    masks = [torch.ones(n) for n in response_lengths]
    pg_loss = torch.randn(sum(response_lengths), generator=g, requires_grad=True)

    pg_weighted, modified_masks, metrics = tis_func(
        args, pg_loss=pg_loss, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks,
        total_lengths=total_lengths, response_lengths=response_lengths)

    per_sample = zip(pg_weighted.split(response_lengths), modified_masks, masks, strict=True)
    loss = sum((x * m).sum() / orig.sum() for x, m, orig in per_sample) / len(masks)
    loss.backward()
    print(f"loss {loss.item():.4f}; kept tokens per sample {[int(m.sum()) for m in modified_masks]}")
    for key in ("mis_k3_kl", "mis_tis_truncate_fraction", "mis_rs_catastrophic_seq_fraction", "mis_batch_norm_factor",
                "mis_ess"):
        print(f"{key} = {metrics[key][0].item():.4g}")


if __name__ == "__main__":
    main()
