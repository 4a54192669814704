"""What idle gloo process groups cost the processes beside them (slime_corr/mcore/parallel_groups.py).

Each gloo group keeps a device thread that wakes every 10 ms (gloo's tcp `Loop::run`: `epoll_wait(..., 10)`), busy
or not; Megatron's `initialize_model_parallel` makes ~20 groups, and `destroy_model_parallel()` alone destroys
none. A holder process makes `--groups` one-rank gloo groups and sleeps; beside it, one busy process per core runs
a fixed amount of matmul work. Rounds alternate 0 and `--groups` idle groups; the medians of the busy processes'
wall times and their ratio are printed.

    python bench/gloo_threads.py                  # 300 groups (a test worker before the fix held 100-140)
    python bench/gloo_threads.py --groups 20      # one Megatron layout
    python bench/gloo_threads.py --markdown docs/benchmarks.md   # also rewrites its table there
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from markdown_table import caption_line, write_block  # bench/markdown_table.py

HOLDER = """
import sys, time, torch.distributed as dist
from slime_corr.ports import init_world_of_one
init_world_of_one("gloo")
groups = [dist.new_group([0]) for _ in range(int(sys.argv[1]))]
print("ready", flush=True)
time.sleep(600)
"""

BUSY = """
import sys, time, torch
torch.set_num_threads(1)
a = torch.randn(256, 256)
start = time.perf_counter()
for _ in range(int(sys.argv[1])):
    a = torch.tanh(a @ a * 0.01)
print(time.perf_counter() - start)
"""


def busy_seconds(groups: int, iters: int, busy: int) -> float:
    """The busy processes' median wall time beside a holder of `groups` idle gloo groups."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(groups)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready", "the holder did not start"
        time.sleep(1.0)
        procs = [subprocess.Popen([sys.executable, "-c", BUSY, str(iters)], stdout=subprocess.PIPE, text=True)
                 for _ in range(busy)]
        return statistics.median(float(p.communicate()[0]) for p in procs)
    finally:
        holder.kill()
        holder.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=300, help="idle gloo groups of the holder (default 300)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each with 0 and --groups (default 5)")
    parser.add_argument("--iters", type=int, default=6000, help="matmuls per busy process (default 6000)")
    parser.add_argument("--busy", type=int, default=os.cpu_count() or 2, help="busy processes (default: cores)")
    parser.add_argument("--markdown", default=None, help="write the table into this file between its markers")
    args = parser.parse_args()
    seconds: dict[int, list[float]] = {0: [], args.groups: []}
    for _ in range(args.rounds):
        for groups in seconds:
            seconds[groups].append(busy_seconds(groups, args.iters, args.busy))
    base, held = (statistics.median(seconds[g]) for g in seconds)
    print(f"{args.busy} busy processes, {args.iters} matmuls each, medians of {args.rounds} rounds:")
    print(f"  beside 0 idle gloo groups: {base:.2f} s")
    print(f"  beside {args.groups} idle gloo groups: {held:.2f} s  ({held / base:.2f}x)")
    if args.markdown:
        caption = caption_line(sys.argv, "cpu", 1, f"{args.busy} busy processes (1 torch thread each), "
                               f"{args.iters} matmuls each, medians of {args.rounds} rounds")
        write_block(args.markdown, "gloo_threads.py", caption,
                    ["idle gloo groups in the holder", "busy processes' wall time, s", "x / none"],
                    [["0", f"{base:.2f}", "1.00x"], [str(args.groups), f"{held:.2f}", f"{held / base:.2f}x"]],
                    title="Idle gloo groups (bench/gloo_threads.py)")


if __name__ == "__main__":
    main()
