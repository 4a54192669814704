"""Torch's intra-op threads on a CPU whose cores are busy: a decode-sized loop at 1 and at 2 threads, on idle cores and
beside busy processes (what a CPU SGLang server meets beside a trainer, and a test worker beside the other one).

Each measurement is a process of its own that runs the loop at one thread count for `--seconds` (as a server does:
its thread pool stays up between ops); the thread counts alternate over `--rounds` rounds and the medians of
calls per second are printed. The busy processes are plain Python loops, ended after each row (and after
`--busy-seconds` in any case).

    python bench/cpu_threads.py                         # SmolLM2-135M sizes: hidden 576, MLP 1536, 8 tokens
    python bench/cpu_threads.py --hidden 64 --ffn 256   # the tests' tiny model
    python bench/cpu_threads.py --markdown docs/benchmarks.md   # also writes the table there (block cpu_threads.py)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from markdown_table import caption_line, write_block  # noqa: E402  # bench/markdown_table.py


def decode_loop(hidden: int, ffn: int, rows: int, layers: int, dtype: torch.dtype):
    """One call: `layers` MLP blocks (matmul, GELU, matmul, layer norm) on `rows` tokens."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    w1 = torch.randn(hidden, ffn, generator=g).to(dtype)
    w2 = torch.randn(ffn, hidden, generator=g).to(dtype)

    def run() -> torch.Tensor:
        h = x
        for _ in range(layers):
            h = torch.nn.functional.layer_norm(torch.nn.functional.gelu(h @ w1) @ w2, (hidden,))
        return h
    return run


def calls_per_second(args: argparse.Namespace, threads: int) -> float:
    """In this process: the loop at `threads` threads for `args.seconds` after 10 warm-up calls."""
    torch.set_num_threads(threads)
    loop = decode_loop(args.hidden, args.ffn, args.rows, args.layers, getattr(torch, args.dtype))
    for _ in range(10):
        loop()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        loop()
        calls += 1
    return calls / (time.perf_counter() - start)


def measure(argv: list[str], threads: int) -> float:
    out = subprocess.run([sys.executable, __file__, *argv, "--child", str(threads)], capture_output=True, text=True,
                         check=True)
    return float(out.stdout.strip())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--threads", default="1,2", help="comma list of thread counts")
    p.add_argument("--busy", default=f"0,{os.cpu_count()}", help="comma list of busy processes beside the loop")
    p.add_argument("--seconds", type=float, default=4.0, help="seconds of one measurement")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--busy-seconds", type=int, default=600, help="the busy processes end after this in any case")
    p.add_argument("--markdown", metavar="FILE", help="also write the table into FILE between its markers")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        print(calls_per_second(args, args.child))
        return
    argv = [f"--{k}={getattr(args, k)}" for k in ("hidden", "ffn", "rows", "layers", "dtype", "seconds")]
    counts = [int(t) for t in args.threads.split(",")]
    base = counts[0]
    what = (f"torch {torch.__version__} | {os.cpu_count()} cores | {args.rows}x{args.hidden}, MLP {args.ffn}, "
            f"{args.layers} layers, {args.dtype} | calls/s, medians of {args.rounds} runs of {args.seconds:g} s")
    header = ["busy processes", *(f"{n} thread(s)" for n in counts), *(f"{base} vs {n} thread(s)" for n in counts[1:])]
    print(what)
    print("| " + " | ".join(header) + " |")
    print("|---|" + "---|" * (2 * len(counts) - 1))
    table = []
    for busy in (int(b) for b in args.busy.split(",")):
        procs = [subprocess.Popen([sys.executable, "-c", f"import time\nend = time.time() + {args.busy_seconds}\n"
                                  "while time.time() < end: pass"]) for _ in range(busy)]
        try:
            runs: dict[int, list[float]] = {n: [] for n in counts}
            for r in range(args.rounds):
                for n in counts if r % 2 == 0 else counts[::-1]:
                    runs[n].append(measure(argv, n))
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
        rate = {n: statistics.median(v) for n, v in runs.items()}
        table.append([str(busy), *(f"{rate[n]:.1f}" for n in counts),
                      *(f"{rate[base] / rate[n]:.2f}x" for n in counts[1:])])
        print("| " + " | ".join(table[-1]) + " |")
    if args.markdown:
        caption = caption_line(sys.argv, "cpu", 0, what.replace(" | ", ", ")).replace(
            "0 torch thread(s)", "torch threads as each column says")
        write_block(args.markdown, "cpu_threads.py", caption, header, table,
                    title="Torch threads beside busy cores (bench/cpu_threads.py)")


if __name__ == "__main__":
    main()
