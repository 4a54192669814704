"""What counting impossible input values costs (`checks.input_value_counts`: loss mask outside {0, 1}, log-probs
> 0 or NaN in the mask), inside one step of correction + loss + backward + `metrics_to_host`, on padded batches.

Both variants run interleaved in one process on the same inputs (medians over repeats): with the counts, and with
the count function replaced by zeros. Prints the ratio with / without (> 1: the counting's share of the step).

    python bench/value_checks.py [--sizes 64x4096,8x32768] [--repeats 41] [--preset decoupled_token_is]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from timing import interleaved_medians  # bench/timing.py (this script's directory is on sys.path)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from slime_corr.config import RolloutCorrectionConfig  # noqa: E402
from slime_corr.correction import core, metrics_to_host  # noqa: E402
from slime_corr.losses import compute_policy_loss  # noqa: E402


def make_inputs(b: int, s: int, mask_dtype: torch.dtype) -> tuple:
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(b, s, generator=g) * 3 - 0.1
    ro = (old + 0.01 * torch.randn(b, s, generator=g)).clamp(max=0.0)
    lp = (old + 0.01 * torch.randn(b, s, generator=g)).clamp(max=0.0)
    adv = torch.randn(b, s, generator=g)
    lengths = torch.randint(s // 4, s + 1, (b,), generator=g)
    return lp, old, ro, adv, (torch.arange(s)[None, :] < lengths[:, None]).to(mask_dtype)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="64x4096,8x32768")
    p.add_argument("--repeats", type=int, default=41)
    p.add_argument("--preset", default="decoupled_token_is")
    args = p.parse_args()
    cfg = RolloutCorrectionConfig.preset(args.preset)
    counts = core.input_value_counts

    def zeros(*_args: object) -> torch.Tensor:
        return torch.zeros(3, dtype=torch.float64)

    print(f"threads={torch.get_num_threads()} repeats={args.repeats} preset={args.preset} (medians, interleaved)")
    for size in args.sizes.split(","):
        b, s = map(int, size.split("x"))
        for mask_dtype in (torch.bool, torch.float32):
            lp, old, ro, adv, mask = make_inputs(b, s, mask_dtype)

            def step(fn=counts, lp=lp, old=old, ro=ro, adv=adv, mask=mask) -> dict[str, float]:
                core.input_value_counts = fn
                x = lp.clone().requires_grad_()
                out = compute_policy_loss(x, None if cfg.use_rollout_logprobs else old, ro, adv, mask, cfg)
                out.loss.backward()
                return metrics_to_host({**out.metrics, "loss": out.loss.detach()}, cfg)

            med = interleaved_medians({"with": step, "without": lambda s=step: s(zeros)}, args.repeats)
            print(f"{size:>8s} {str(mask_dtype):14s}: with {med['with'] * 1e3:8.2f} ms  without "
                  f"{med['without'] * 1e3:8.2f} ms  with / without {med['with'] / med['without']:.3f}")
    core.input_value_counts = counts


if __name__ == "__main__":
    main()
