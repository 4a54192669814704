"""The exact weight-quantile sketch (`slime_corr/correction/quantiles.py`) under its two ways of counting histograms,
on one device: `counting` (bincount / index_add_: the CPU's; on an accelerator a contended atomic scatter, and
bincount syncs with the host) and `sorting` (one sort, then searchsorted: every other device's). Times one call's
three rounds (level 1, then `refine`) on token weights that all sit near 1.0 (the contended case: few bins) and on
spread ones, and checks both give the same statistics.

    MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_MMAP_THRESHOLD_=1073741824 python bench/quantile_backends.py  # CPU
    python bench/quantile_backends.py --device cuda --sizes 64x8192,1024x8192

(On the CPU, glibc's default thresholds return the freed 2 MiB blocks to the system between calls, and the page
faults of the next call can cost more than the counting itself.)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from slime_corr.correction import quantiles


def one_call(w: torch.Tensor, unit: torch.Tensor) -> dict[str, torch.Tensor]:
    hist, counts = quantiles.level1(w, unit, binary=True)
    return {quantiles.LEVEL1_KEY: hist, **quantiles.refine(counts, hist, [])}


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median seconds per call (the device synchronized around each)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--sizes", default="64x8192")
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    backends = {"counting": {device.type}, "sorting": set()}  # on an accelerator, counting syncs (bincount)
    print(f"device {device} | torch {torch.__version__} | threads {torch.get_num_threads()} | medians of "
          f"{args.repeats}")
    print("| weights | size | counting ms | sorting ms | same statistics |")
    print("|---|---|---|---|---|")
    for size in args.sizes.split(","):
        b, s = (int(v) for v in size.split("x"))
        g = torch.Generator().manual_seed(0)
        unit = (torch.rand(b, s, generator=g) < 0.8).float()
        for name, spread in (("within 1e-4 of 1", 1e-5), ("spread 1", 1.0)):
            w = ((spread * torch.randn(b, s, generator=g)).exp() * unit).to(device)
            u = unit.to(device)
            ms, stats = {}, {}
            for backend, devices in backends.items():
                quantiles.COUNTING_DEVICES = devices
                ms[backend] = timed(lambda w=w, u=u: one_call(w, u), args.repeats, device) * 1e3
                stats[backend] = one_call(w, u)
            quantiles.COUNTING_DEVICES = {"cpu"}
            same = all(torch.equal(v, stats["sorting"][k]) for k, v in stats["counting"].items())
            print(f"| {name} | {size} | {ms['counting']:.3f} | {ms['sorting']:.3f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
