"""This checkout's correction + loss against an earlier git revision of it, in one process, on padded batches.

The revision's `slime_corr` is exported with `git archive` into a temporary directory and imported under another
name (`slime_corr_base`, imports rewritten), so both run interleaved in the same process on the same inputs
(medians over repeats): load on a shared machine shifts both alike. The results are compared first (every metric
and the loss to 1e-5). Prints one line per size with the ratio this / revision (< 1: this checkout is faster).

    python bench/vs_revision.py --revision ab7b5d0 [--sizes 64x8192,256x2048,8x32768] [--repeats 41]
"""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from timing import interleaved_medians  # bench/timing.py (this script's directory is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
CASES = {  # preset -> options: a sequence-level, a token-level and a REINFORCE configuration
    "decoupled_seq_is_rs": dict(tis_batch_normalize=True, rs_lower_bound=0.1, rs_upper_bound=10.0,
                                rs_veto_threshold=1e-4),
    "decoupled_token_is": {},
    "pg_is": {},
}


def import_revision(revision: str, into: Path) -> tuple:
    """(config, losses, correction) modules of `revision`'s slime_corr, imported as slime_corr_base."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "slime_corr"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    package = into / "slime_corr_base"
    (into / "slime_corr").rename(package)
    for path in package.rglob("*.py"):
        path.write_text(re.sub(r"\bslime_corr\b", "slime_corr_base", path.read_text()))
    sys.path.insert(0, str(into))
    return tuple(importlib.import_module(f"slime_corr_base.{m}") for m in ("config", "losses", "correction"))


def step_fn(modules: tuple, preset: str, inputs: tuple):
    config, losses, correction = modules
    cfg = config.RolloutCorrectionConfig.preset(preset, **CASES[preset])
    lp, old, ro, adv, mask = inputs

    def step() -> dict[str, float]:
        x = lp.clone().requires_grad_()
        out = losses.compute_policy_loss(x, None if cfg.use_rollout_logprobs else old, ro, adv, mask, cfg)
        out.loss.backward()
        return correction.metrics_to_host({**out.metrics, "loss": out.loss.detach()})

    return step


def make_inputs(b: int, s: int) -> tuple:
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(b, s, generator=g) * 3
    ro = old + 0.01 * torch.randn(b, s, generator=g)
    lp = old + 0.01 * torch.randn(b, s, generator=g)
    adv = torch.randn(b, s, generator=g)
    lengths = torch.randint(s // 4, s + 1, (b,), generator=g)
    return lp, old, ro, adv, torch.arange(s)[None, :] < lengths[:, None]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--revision", required=True, help="git revision to compare with (e.g. the branch's base)")
    p.add_argument("--sizes", default="64x8192,256x2048,8x32768")
    p.add_argument("--presets", default=",".join(CASES))
    p.add_argument("--repeats", type=int, default=41)
    args = p.parse_args()
    import slime_corr.config
    import slime_corr.correction
    import slime_corr.losses

    ours = (slime_corr.config, slime_corr.losses, slime_corr.correction)
    with tempfile.TemporaryDirectory() as tmp:
        theirs = import_revision(args.revision, Path(tmp))
        print(f"threads={torch.get_num_threads()} repeats={args.repeats} (medians, interleaved) vs {args.revision}")
        for size, preset in zip(args.sizes.split(","), args.presets.split(","), strict=True):
            b, s = map(int, size.split("x"))
            inputs = make_inputs(b, s)
            fns = {"revision": step_fn(theirs, preset, inputs), "this": step_fn(ours, preset, inputs)}
            want, got = fns["revision"](), fns["this"]()
            bad = [k for k in want if abs(want[k] - got.get(k, float("nan"))) > 1e-5 * max(1.0, abs(want[k]))]
            if set(want) - set(got) or bad:  # metrics this checkout adds are allowed; none may go missing
                raise SystemExit(f"{preset} {size}: results differ ({bad or set(want) - set(got)})")
            med = interleaved_medians(fns, args.repeats)
            print(f"{preset:20s} {size:>8s}: revision {med['revision'] * 1e3:8.2f} ms  this {med['this'] * 1e3:8.2f} "
                  f"ms  this / revision {med['this'] / med['revision']:.3f}")


if __name__ == "__main__":
    main()
