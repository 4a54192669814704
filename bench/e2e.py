"""End-to-end benchmark of the main job (not part of the test suite).

    python bench/e2e.py [--repeats 3] [--num-rollout 5] [--nproc 1] [--rollout-engine sglang] [-- main-job flags]
    python bench/e2e.py --markdown docs/benchmarks.md   # also writes its two tables there (blocks e2e.py, e2e.py ratios)

Runs the real trainer (`python -m slime_corr.main`, or torchrun with `--nproc` processes) in six variants,
interleaved `--repeats` times: decoupled PPO with sequence IS + RS (`decoupled_seq_is_rs`), the same with π_old by
`--prox-logp-method loglinear` instead of the recompute pass, and bypass PPO (`ppo_is_bypass`), each synchronous
and asynchronous (`--async-rollout`); `--variants` picks some (e.g. `--variants decoupled loglinear`). From each run's metrics.jsonl (the
trainer's own `perf/*` timers) it takes, per rollout, leaving out the first (warm-up) and the last (the asynchronous
pipeline has nothing left to generate there):

  rollout      waiting for the rollout's samples (async: only what generation did not hide behind training)
  lp_old/ref   the forward-only pass before a rollout's first update (lp_old in decoupled mode; 0 in bypass)
  train        forward + backward + optimizer of the rollout's steps (without that pass)
  weight sync  pushing the new weights to the engines
  other        the rest of the iteration (advantages, DP plan, scatter, micro-batches, logging)
  loss share   the loss functions' forward (log-probs from logits, correction, policy loss), as a share of the
               training time and of the whole iteration

The engines are real SGLang servers launched by the trainer (`--rollout-engine sglang`, the default; their start-up
is outside the measured rollouts) or the embedded engine. It prints medians over runs (seconds per rollout), each
part's share of the wall time per rollout, then ratios in the same run: bypass / decoupled and
async / sync of the wall time per rollout, decoupled / bypass of the training part (what the extra pass costs), and
loglinear / decoupled of the wall time and of the training part (what the log-linear π_old saves).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from markdown_table import caption_line, write_block  # noqa: E402  # bench/markdown_table.py

LOGLINEAR = ["--prox-logp-method", "loglinear", "--prox-logp-error-interval", "0"]  # no recompute pass at all
VARIANTS = {
    "decoupled sync": ["--rollout-correction-preset", "decoupled_seq_is_rs"],
    "bypass sync": ["--rollout-correction-preset", "ppo_is_bypass"],
    "decoupled async": ["--rollout-correction-preset", "decoupled_seq_is_rs", "--async-rollout"],
    "bypass async": ["--rollout-correction-preset", "ppo_is_bypass", "--async-rollout"],
    "loglinear sync": ["--rollout-correction-preset", "decoupled_seq_is_rs", *LOGLINEAR],
    "loglinear async": ["--rollout-correction-preset", "decoupled_seq_is_rs", "--async-rollout", *LOGLINEAR],
}
PARTS = ("rollout", "lp_old/ref", "train", "weight sync", "other", "wall")


def run_variant(flags: list[str], args: argparse.Namespace, work: Path) -> dict[str, float]:
    """One trainer run; the per-rollout medians of each part, and the loss share of training."""
    main = ["-m", "slime_corr.main", "--num-rollout", str(args.num_rollout), "--rollout-progress", "none",
            "--no-log-mismatch-diagnostics", "--work-dir", str(work), "--rollout-engine", args.rollout_engine, *flags,
            *args.extra]
    if args.nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
               *main]
    else:
        cmd = [sys.executable, *main]
    # the device is the job's to decide (slime_corr.device: a GPU when there is one; `-- --device cpu` to pin it)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    by_rollout: dict[int, list[dict]] = {}
    for r in records:
        by_rollout.setdefault(int(r["rollout/index"]), []).append(r)
    rows = []
    for _, steps in sorted(by_rollout.items())[1:-1]:  # the first: warm-up; the last: the pipeline drains
        first = steps[0]
        row = {"rollout": first["perf/rollout_time"], "lp_old/ref": first["perf/prepare_time"],
               "train": sum(s["perf/train_time"] for s in steps), "weight sync": first["perf/weight_sync_time"],
               "wall": sum(s["perf/step_time"] for s in steps), "loss": sum(s["perf/loss_time"] for s in steps)}
        row["other"] = row["wall"] - row["rollout"] - row["lp_old/ref"] - row["train"] - row["weight sync"]
        rows.append(row)
    out = {k: statistics.median(r[k] for r in rows) for k in (*PARTS, "loss")}
    out["loss share"] = statistics.median(r["loss"] / r["train"] for r in rows)
    out["loss/wall"] = statistics.median(r["loss"] / r["wall"] for r in rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-rollout", type=int, default=6, help="Rollouts per run (the first and last are not "
                                                                "measured).")
    ap.add_argument("--nproc", type=int, default=1, help="Processes per run (torchrun when > 1).")
    ap.add_argument("--rollout-engine", choices=("sglang", "embedded"), default="sglang",
                    help="The engines the trainer launches (real SGLang servers, or the embedded engine).")
    ap.add_argument("--variants", nargs="+", choices=("decoupled", "bypass", "loglinear"),
                    default=["decoupled", "bypass", "loglinear"], help="Which corrections to run (each sync and async).")
    ap.add_argument("--markdown", metavar="FILE", help="Also write the two tables into FILE between their markers "
                    "(blocks e2e.py: seconds and shares per rollout; e2e.py ratios).")
    ap.add_argument("extra", nargs="*", help="Flags for every run (after --), e.g. -- --rollout-batch-size 8.")
    args = ap.parse_args()
    if args.num_rollout < 3:
        ap.error("--num-rollout must be >= 3 (the first and the last rollout are not measured)")
    variants = {name: flags for name, flags in VARIANTS.items() if name.split()[0] in args.variants}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory(prefix="slime_corr_e2e_") as tmp:
        for rep in range(args.repeats):  # interleaved: every variant once per repeat
            for i, (name, flags) in enumerate(variants.items()):
                results[name].append(run_variant(flags, args, Path(tmp) / f"{rep}-{i}"))
                print(f"repeat {rep + 1}/{args.repeats}: {name} done", file=sys.stderr, flush=True)
    med = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in results.items()}
    print(f"seconds per rollout (median of {args.repeats} runs × {args.num_rollout - 2} rollouts; "
          f"{args.nproc} process(es); engine: {args.rollout_engine}); extra flags: {' '.join(args.extra) or 'none'}")
    print(f"{'variant':<18}" + "".join(f"{p:>13}" for p in PARTS) + f"{'loss/train':>12}{'loss/wall':>11}")
    for name, m in med.items():
        print(f"{name:<18}" + "".join(f"{m[p]:>13.4f}" for p in PARTS)
              + f"{m['loss share']:>11.1%}{m['loss/wall']:>11.1%}")
    print("share of the wall time per rollout:")
    for name, m in med.items():
        print(f"  {name:<16}" + "   ".join(f"{p} {m[p] / m['wall']:.1%}" for p in PARTS[:-1])
              + f"   (the correction's loss {m['loss/wall']:.1%})")
    print("ratios (same run):")
    ratios: list[list[str]] = []
    for mode in ("sync", "async"):
        if f"decoupled {mode}" not in med:
            continue
        d = med[f"decoupled {mode}"]
        if f"bypass {mode}" in med:
            b = med[f"bypass {mode}"]
            wall, train = b["wall"] / d["wall"], (d["lp_old/ref"] + d["train"]) / (b["lp_old/ref"] + b["train"])
            print(f"  {mode:<5}  bypass / decoupled wall {wall:.3f}   decoupled / bypass (lp_old/ref + train) "
                  f"{train:.3f}")
            ratios += [[f"{mode}: bypass / decoupled, wall", f"{wall:.3f}"],
                       [f"{mode}: decoupled / bypass, lp_old/ref + train", f"{train:.3f}"]]
        if f"loglinear {mode}" in med:
            ll = med[f"loglinear {mode}"]
            wall, train = ll["wall"] / d["wall"], (ll["lp_old/ref"] + ll["train"]) / (d["lp_old/ref"] + d["train"])
            print(f"  {mode:<5}  loglinear / decoupled wall {wall:.3f}   (lp_old/ref + train) {train:.3f}   "
                  f"(lp_old/ref {d['lp_old/ref']:.4f} s -> {ll['lp_old/ref']:.4f} s)")
            ratios += [[f"{mode}: lp_old/ref pass, s per rollout, decoupled → loglinear",
                        f"{d['lp_old/ref']:.4f} → {ll['lp_old/ref']:.4f}"],
                       [f"{mode}: loglinear / decoupled, lp_old/ref + train", f"{train:.3f}"],
                       [f"{mode}: loglinear / decoupled, wall", f"{wall:.3f}"]]
    for corr in args.variants:
        s, a = med[f"{corr} sync"], med[f"{corr} async"]
        print(f"  {corr:<9}  async / sync wall {a['wall'] / s['wall']:.3f}   (rollout wait {s['rollout']:.3f} s "
              f"-> {a['rollout']:.3f} s)")
        ratios += [[f"{corr}: async / sync, wall", f"{a['wall'] / s['wall']:.3f}"],
                   [f"{corr}: rollout wait, s per rollout, sync → async", f"{s['rollout']:.3f} → {a['rollout']:.3f}"]]
    if args.markdown:
        load = "/".join(f"{x:.1f}" for x in os.getloadavg())
        caption = caption_line(sys.argv, job_device(args.extra), torch_threads(),
                               f"the {args.rollout_engine} engine, {args.nproc} process(es), medians of {args.repeats} runs × {args.num_rollout - 2} "
                               f"rollouts, variants interleaved; load average {load} (1/5/15 min) at the end")
        shares = [[name, *(f"{m[p]:.4f} ({m[p] / m['wall']:.1%})" for p in PARTS[:-1]), f"{m['wall']:.4f}",
                   f"{m['loss share']:.1%}", f"{m['loss/wall']:.1%}"] for name, m in med.items()]
        write_block(args.markdown, "e2e.py", caption,
                    ["variant", *(f"{p}, s (share of wall)" for p in PARTS[:-1]), "wall, s per rollout",
                     "loss / train", "loss / wall"], shares, title="The main job end to end (bench/e2e.py)")
        write_block(args.markdown, "e2e.py ratios", caption, ["in the same run", "value"], ratios,
                    title="The main job end to end: ratios (bench/e2e.py ratios)")


def job_device(extra: list[str]) -> str:
    """Where the trainer ran: the job's own choice (slime_corr.device: a GPU when there is one), or `--device`."""
    import torch

    flags = " ".join(extra)
    if "--device cpu" in flags or "--device=cpu" in flags or not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name()


def torch_threads() -> int:
    """The torch threads of the trainer's processes: OMP_NUM_THREADS as they inherit it, else torch's default."""
    import torch

    return int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))

if __name__ == "__main__":
    main()
