"""Replaying the engine's kept sets (`--rollout-return-sampling-mask`) against the nucleus-mass correction
(`--rollout-nucleus-logprobs`) and no correction: the mismatch each leaves, and what the replay costs.

Run: `python bench/kept_sets.py [--engines embedded sglang] [--samples 24] [--tokens 16] [--trainer 2048x32768]`
[--markdown docs/benchmarks.md] (also writes the three tables there: blocks `kept_sets.py` (the mismatch),
`kept_sets.py cost` (wire and client) and `kept_sets.py trainer`; bench/markdown_table.py).
  * mismatch: the engine (embedded, and the real SGLang server when installed: bf16, the tiny model) samples
    `--samples` responses of `--tokens` tokens under top-p 0.9 (sent with top_k 4096 for the mask) and under top-k 20,
    with its sampling mask and its top-20 log-probs; the trainer (fp32, the same weights, teacher-forced) gives per
    token x = lp_train − lp_rollout under each treatment: none (both untruncated), nucleus mass (the trainer's own
    top-k / top-p log-prob against lp_rollout − log M, M the engine's mass where its top-20 hold the boundary, the
    trainer's elsewhere; tokens outside the trainer's nucleus left out, counted), replay (the trainer's log-prob over
    the engine's kept set against the engine's renormalized one). Reported: k3 = mean(e^x − x − 1) and mean |x|.
  * wire and client: bytes per response token of the engine's non-streamed JSON body without extras, with the
    top-20 log-probs, and with the sampling mask + support log-probs; the client's `json.loads` +
    `parse_generate_response` per token (interleaved medians, bench/timing.py).
  * trainer: one micro-batch of `--trainer` T x V fp32 logits, kept-set sizes drawn like a peer's measurement (half
    singletons, median 2, p99 ≈ 80): forward + backward of the log-probs by the replay (`kept_token_log_softmax`
    alone, and `nucleus.replayed_log_probs`, which adds the full pass for log M and the entropy), a dense [T, V] mask
    (what slime builds: masked_fill −inf, log_softmax), the trainer's own nucleus and the plain full log-softmax;
    ms (median of `--repeats`) and extra peak memory (one process per variant: VmHWM after the inputs and one
    warm-up call, glibc's mmap threshold fixed at 128 KiB, as bench/logprobs.py measures).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "bench"))

from markdown_table import caption_line, write_block  # noqa: E402  # bench/markdown_table.py
from timing import interleaved_medians  # noqa: E402

from slime_corr.mcore.kept_set import kept_token_log_softmax  # noqa: E402
from slime_corr.mcore.logprobs import LogSoftmaxSpec, token_log_softmax  # noqa: E402
from slime_corr.mcore.nucleus import replayed_log_probs  # noqa: E402
from slime_corr.mcore.truncated_logprobs import truncated_token_log_softmax  # noqa: E402
from slime_corr.rollout.nucleus import NucleusRequest, engine_nucleus  # noqa: E402
from slime_corr.rollout.protocol import parse_generate_response, sampling_mask_params  # noqa: E402

T = 1.0
SETTINGS = {"top-p 0.9": (0.9, -1), "top-k 20": (1.0, 20)}
TOP_N = 20


# ---------------------------------------------------------------------------------------------- mismatch
async def _post(url: str, body: dict) -> bytes:
    async with aiohttp.ClientSession() as s, s.post(url + "/generate", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.read()


def _body(prompt: list[int], tokens: int, top_p: float, top_k: int, seed: int, extras: str) -> dict:
    params = sampling_mask_params({"max_new_tokens": tokens, "temperature": T, "top_p": top_p, "top_k": top_k,
                                   "ignore_eos": True, "sampling_seed": seed})
    body = {"input_ids": prompt, "return_logprob": True, "sampling_params": params}
    if extras in ("top", "both"):
        body["top_logprobs_num"] = TOP_N
    if extras in ("mask", "both"):
        body.update(return_sampling_mask=True, sampling_logprobs_mode="support")
    return body


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(32, 127, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _k3(x: torch.Tensor) -> tuple[float, float, int]:
    x = x.clamp(-20, 20)
    return float((x.exp() - x - 1).mean()), float(x.abs().mean()), x.numel()


def mismatch(url: str, logits_of, samples: int, tokens: int) -> dict[str, dict[str, tuple]]:
    """{setting: {treatment: (k3, mean |x|, tokens)}} for the engine at `url`; `logits_of(prompt, response)` gives the
    trainer's fp32 logits [len(response), V] at the response positions."""
    out = {}
    for name, (top_p, top_k) in SETTINGS.items():
        xs: dict[str, list[torch.Tensor]] = {"none": [], "nucleus mass": [], "replay": []}
        outside = total = 0
        for i, prompt in enumerate(_prompts(samples)):
            raw = asyncio.run(_post(url, _body(prompt, tokens, top_p, top_k, 100 + i, "both")))
            obj = json.loads(raw)
            res = parse_generate_response(obj, nucleus=NucleusRequest(top_p, min(top_k, 4096) if top_k > 0 else -1,
                                                                      TOP_N), sampling_mask=True)
            y = torch.tensor(res.output_ids)
            lp = torch.tensor(res.log_probs, dtype=torch.float64)
            z = logits_of(prompt, res.output_ids).double()
            full = torch.log_softmax(z / T, -1).gather(-1, y[:, None])[:, 0]
            xs["none"].append(full - lp)
            counts = torch.tensor([len(k) for k in res.kept_ids], dtype=torch.int32)
            ids = torch.tensor([i for k in res.kept_ids for i in k], dtype=torch.int32)
            replay = kept_token_log_softmax(z, y, counts, ids, temperature=T)
            engine_trunc = torch.tensor([lps[k.index(t)] for k, lps, t in zip(res.kept_ids, res.kept_log_probs,
                                                                                 res.output_ids, strict=True)],
                                        dtype=torch.float64)
            xs["replay"].append(replay.log_probs - engine_trunc)
            own = truncated_token_log_softmax(z, y, top_k=top_k, top_p=top_p, temperature=T)
            top = engine_nucleus(torch.tensor(res.top_log_probs, dtype=torch.float64), torch.tensor(res.top_ids), y,
                                 lp, top_p=top_p, top_k=top_k)
            mass = torch.where(top.fits, top.log_mass, own.log_mass)
            inside = own.in_kept
            xs["nucleus mass"].append((own.log_probs - (lp - mass))[inside])
            outside += int((~inside).sum())
            total += y.numel()
        out[name] = {k: _k3(torch.cat(v)) for k, v in xs.items()}
        out[name]["outside"] = (outside / max(total, 1),)
    return out


def embedded_engine(ckpt: str):
    from slime_corr.engines.embedded.engine import start_local_engine
    from slime_corr.engines.embedded.model import load_tiny_lm

    model = load_tiny_lm(ckpt)

    def logits_of(prompt, response):
        with torch.no_grad():
            return model(torch.tensor([prompt + response]))[0, len(prompt) - 1:-1].float()

    return start_local_engine(ckpt, dtype=torch.bfloat16), logits_of


def wire_and_client(url: str, tokens: int, repeats: int) -> dict[str, tuple[float, float]]:
    """{shape: (bytes per token, client µs per token)} of the engine's non-streamed bodies."""
    prompt = _prompts(1)[0]
    bodies = {extras: asyncio.run(_post(url, _body(prompt, tokens, 0.9, -1, 7, extras)))
              for extras in ("none", "top", "mask")}
    n = len(json.loads(bodies["none"])["output_ids"])
    parse = {"none": lambda: parse_generate_response(json.loads(bodies["none"])),
             "top": lambda: parse_generate_response(json.loads(bodies["top"]), nucleus=NucleusRequest(0.9, 4096, TOP_N)),
             "mask": lambda: parse_generate_response(json.loads(bodies["mask"]), sampling_mask=True)}
    times = interleaved_medians(parse, repeats)
    return {k: (len(bodies[k]) / n, times[k] / n * 1e6) for k in bodies}


# ---------------------------------------------------------------------------------------------- trainer cost
def kept_sizes(tokens: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Half singletons, the rest 2 + a Pareto tail: median 2, p99 ≈ 80 (a peer's measurement)."""
    g = torch.Generator().manual_seed(seed)
    tail = (2 + (torch.rand(tokens, generator=g).pow(-1 / 1.2) - 1) * 3).floor().clamp_max(vocab)
    return torch.where(torch.rand(tokens, generator=g) < 0.5, 1.0, tail).long()


def trainer_inputs(tokens: int, vocab: int):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(tokens, vocab, generator=g) * 3
    sizes = kept_sizes(tokens, vocab)
    order = logits.argsort(-1, descending=True)
    ids = torch.cat([order[t, : int(sizes[t])] for t in range(tokens)]).to(torch.int32)
    labels = order[:, 0]  # the top token: in every set
    return logits, labels, sizes.to(torch.int32), ids


def trainer_variant(name: str, logits, labels, counts, ids):
    """A function that runs one forward + backward of `name` on fresh-grad logits."""
    def run():
        x = logits.detach().requires_grad_()
        if name == "replay (kept ids only)":
            lp = kept_token_log_softmax(x, labels, counts, ids).log_probs
        elif name == "replay (+ full pass: log M, entropy)":
            batch = {"labels": labels, "rollout_kept_token_counts": counts, "rollout_kept_token_ids": ids}
            lp = replayed_log_probs(x, batch, with_entropy=True, entropy_grad=False).nucleus.log_probs
        elif name == "dense [T, V] mask":
            rows = torch.repeat_interleave(torch.arange(labels.numel()), counts.long())
            keep = torch.zeros(x.shape, dtype=torch.bool)
            keep[rows, ids.long()] = True
            lp = torch.log_softmax(x.masked_fill(~keep, -torch.inf), -1).gather(-1, labels[:, None])[:, 0]
        elif name == "trainer's nucleus (top-p 0.9)":
            lp = truncated_token_log_softmax(x, labels, top_p=0.9).log_probs
        else:  # full log-softmax
            lp = token_log_softmax(x, labels, LogSoftmaxSpec()).log_probs
        lp.sum().backward()
        return x.grad

    return run


TRAINER_VARIANTS = ("full log-softmax", "replay (kept ids only)", "replay (+ full pass: log M, entropy)",
                    "dense [T, V] mask", "trainer's nucleus (top-p 0.9)")
# the variants as docs/benchmarks.md names them
TRAINER_LABELS = {"full log-softmax": "full log-softmax (no truncation)",
                  "replay (kept ids only)": "replay, the kept ids alone",
                  "replay (+ full pass: log M, entropy)": "replay as the hook runs it (+ a no-grad full pass: log M, "
                                                          "entropy)",
                  "dense [T, V] mask": "dense [T, V] mask (masked_fill −inf, log_softmax: slime's way)",
                  "trainer's nucleus (top-p 0.9)": "the trainer's own nucleus (top-p 0.9: a sort per chunk)"}
ENGINE_LABELS = {"embedded": "embedded", "sglang": "real SGLang"}
TREATMENTS = ("none", "nucleus mass", "replay")


def _vm_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def child(spec: dict) -> None:
    torch.set_num_threads(spec["threads"])
    tokens, vocab = spec["tokens"], spec["vocab"]
    inputs = trainer_inputs(tokens, vocab)
    fn = trainer_variant(spec["variant"], *inputs)
    fn()  # warm-up
    if spec["memory"]:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = _vm_kib("VmRSS")
        fn()
        print(json.dumps({"peak_mib": (_vm_kib("VmHWM") - before) / 1024}))
    else:
        times = []
        for _ in range(spec["repeats"]):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        print(json.dumps({"ms": statistics.median(times) * 1e3}))


def run_child(spec: dict) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]))
    if spec["memory"]:
        env.update(MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072", MALLOC_TOP_PAD_="0")
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                          env=env, timeout=3600)
    if proc.returncode:
        return {"failed": proc.stderr.strip().splitlines()[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="*", default=["embedded", "sglang"])
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--trainer", default="2048x32768", help="T x V of the trainer's micro-batch ('' to skip)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--markdown", metavar="FILE", help="also write the three tables into FILE between their "
                        "markers (blocks kept_sets.py, kept_sets.py cost, kept_sets.py trainer)")
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    mismatches: dict[str, dict] = {}
    wires: dict[str, dict] = {}
    for engine in args.engines:
        with tempfile.TemporaryDirectory() as tmp:
            if engine == "embedded":
                from slime_corr.engines.embedded.model import create_tiny_checkpoint

                manager, logits_of = embedded_engine(create_tiny_checkpoint(str(Path(tmp) / "v0"), seed=0))
            else:
                manager, logits_of = sglang_engine(Path(tmp))
            with manager as handle:
                url = handle.url
                table = mismatch(url, logits_of, args.samples, args.tokens)
                wire = wire_and_client(url, args.tokens * 4, 50)
        mismatches[engine], wires[engine] = table, wire
        print(f"\n{engine} engine (bf16), fp32 trainer, T = {T}: per token x = lp_train - lp_rollout")
        print("| setting | treatment | k3 | mean abs x | tokens |\n|---|---|---|---|---|")
        for setting, rows in table.items():
            for treatment, (k3, ax, n) in ((k, v) for k, v in rows.items() if k != "outside"):
                print(f"| {setting} | {treatment} | {k3:.2e} | {ax:.2e} | {n} |")
            print(f"| {setting} | (nucleus mass: tokens outside the trainer's nucleus) | {rows['outside'][0]:.2%} | | |")
        print("| response body | bytes / token | client µs / token |\n|---|---|---|")
        for shape, (size, us) in wire.items():
            label = {"none": "log-probs only", "top": f"+ top-{TOP_N} log-probs", "mask": "+ sampling mask (support)"}
            print(f"| {label[shape]} | {size:.0f} | {us:.1f} |")
    trainer: dict[str, tuple[float, float, str]] = {}
    sizes_note = ""
    if args.trainer:
        tokens, vocab = (int(x) for x in args.trainer.split("x"))
        sizes = kept_sizes(tokens, vocab).double()
        sizes_note = (f"kept sets: mean {sizes.mean():.1f}, median {sizes.median():.0f}, p99 "
                      f"{sizes.quantile(0.99):.0f}, singletons {(sizes == 1).double().mean():.0%}, "
                      f"Σ {int(sizes.sum())} ids")
        print(f"\ntrainer: T={tokens} V={vocab} fp32 logits, forward + backward, {args.threads} threads; {sizes_note}")
        print("| variant | ms | extra peak MiB |\n|---|---|---|")
        for variant in TRAINER_VARIANTS:
            spec = {"variant": variant, "tokens": tokens, "vocab": vocab, "threads": args.threads,
                    "repeats": args.repeats}
            timed = run_child({**spec, "memory": False})
            mem = run_child({**spec, "memory": True})
            failed = timed.get("failed") or mem.get("failed") or ""
            trainer[variant] = (timed.get("ms", math.nan), mem.get("peak_mib", math.nan), failed)
            print(f"| {variant} | {trainer[variant][0]:.1f} | {trainer[variant][1]:.0f} |"
                  + (f" {failed}" if failed else ""))
    if args.markdown:
        write_markdown(args, mismatches, wires, trainer, sizes_note)


def write_markdown(args: argparse.Namespace, mismatches: dict[str, dict], wires: dict[str, dict],
                   trainer: dict[str, tuple[float, float, str]], sizes_note: str) -> None:
    """The three tables into `args.markdown`, one block each (bench/markdown_table.py)."""
    def title(name: str) -> str:  # the section a block absent from the file gets
        return f"Replaying the engine's kept sets (bench/{name})"

    engines = ", ".join(ENGINE_LABELS.get(e, e) for e in mismatches)
    if mismatches:
        caption = caption_line(sys.argv, "cpu", torch.get_num_threads(),
                               f"engines: {engines} (bf16), the tiny model; an fp32 trainer of the same weights, "
                               f"{args.samples} responses of {args.tokens} tokens per setting, T = {T}; per token "
                               "x = lp_train − lp_rollout, k3 = mean(e^x − x − 1)")
        rows = []
        for engine, table in mismatches.items():
            for setting, res in table.items():
                rows.append([f"{ENGINE_LABELS.get(engine, engine)}, {setting}",
                             " / ".join(f"{res[t][0]:.2e}" for t in TREATMENTS),
                             " / ".join(f"{res[t][1]:.2e}" for t in TREATMENTS),
                             f"{res['outside'][0]:.2%}"])
        write_block(args.markdown, "kept_sets.py", caption,
                    ["engine, setting", "k3: none / nucleus mass / replay", "mean |x|: none / nucleus mass / replay",
                     "outside the trainer's nucleus"], rows, title=title("kept_sets.py"))
        caption = caption_line(sys.argv, "cpu", torch.get_num_threads(),
                               f"engines: {engines}; one {args.tokens * 4}-token response under top-p 0.9, its "
                               "non-streamed JSON body; client: `json.loads` + `parse_generate_response` "
                               "(the checks), interleaved medians of 50")
        rows = []
        for engine, wire in wires.items():
            rows.append([f"bytes / token, {ENGINE_LABELS.get(engine, engine)}",
                         *(f"{wire[k][0]:.0f}" for k in ("none", "top", "mask"))])
        for engine, wire in wires.items():
            rows.append([f"client µs / token, {ENGINE_LABELS.get(engine, engine)}",
                         *(f"{wire[k][1]:.1f}" for k in ("none", "top", "mask"))])
        write_block(args.markdown, "kept_sets.py cost", caption,
                    ["cost", "log-probs only", f"+ top-{TOP_N} log-probs", "+ sampling mask (support log-probs)"],
                    rows, title=title("kept_sets.py cost"))
    if trainer:
        caption = caption_line(sys.argv, "cpu", args.threads,
                               f"one T x V = {args.trainer} fp32 micro-batch, forward + backward; {sizes_note}; "
                               f"ms: median of {args.repeats}; extra peak: VmHWM of a process of its own")
        rows = [[TRAINER_LABELS[v], f"{ms:.0f}", f"{mib:.0f}" + (f" ({failed})" if failed else "")]
                for v, (ms, mib, failed) in trainer.items()]
        write_block(args.markdown, "kept_sets.py trainer", caption,
                    ["trainer, one micro-batch", "ms", "extra peak MiB"], rows, title=title("kept_sets.py trainer"))


def sglang_engine(tmp: Path):
    """A real SGLang server (bf16) serving the tiny model as its OPT checkpoint, and the trainer's fp32 Megatron
    model of the same weights (teacher-forced)."""
    sys.path.insert(0, str(ROOT / "tests" / "mcore"))
    from mcore_helpers import init_layout, run_in_process

    from slime_corr.engines.launch import engine_device
    from slime_corr.engines.sglang_server import SGLangServerConfig, launch_sglang_server, sglang_python
    from slime_corr.mcore.model import TinyGPTArgs, build_tiny_gpt
    from slime_corr.mcore.params import full_named_tensors
    from slime_corr.models.tiny_opt import opt_weights, write_opt_checkpoint

    state: dict = {}

    def build(rank: int, world: int) -> None:
        init_layout(1, 1)
        args = TinyGPTArgs(vocab_size=256, seed=1234)
        model = build_tiny_gpt(args, ddp=False).eval()
        named = dict(full_named_tensors(model))
        write_opt_checkpoint(dict(opt_weights(named.items(), args.num_attention_heads)), args, tmp / "v0")
        state["named"] = {k: v.clone() for k, v in named.items()}

    run_in_process(build)

    def logits_of(prompt, response):
        out = []

        def fn(rank: int, world: int) -> None:
            init_layout(1, 1)
            model = build_tiny_gpt(TinyGPTArgs(vocab_size=256, seed=1234), ddp=False).eval()
            ids = torch.tensor([prompt + response])
            with torch.no_grad():
                out.append(model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None],
                                 attention_mask=None)[0, len(prompt) - 1:-1].float())

        run_in_process(fn)
        return out[0]

    config = SGLangServerConfig(model_path=str(tmp / "v0"), python=sglang_python(), dtype="bfloat16",
                                device=engine_device(), skip_tokenizer_init=True, weight_version="v0",
                                log_dir=tmp / "logs", startup_timeout=600)
    return launch_sglang_server(config, name="bench"), logits_of


if __name__ == "__main__":
    main()
