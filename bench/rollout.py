"""Rollout benchmark on loopback (not part of the test suite).

    python bench/rollout.py [--sections streaming weight-sync engines] [--tokens 32] [--repeats 3]
                            [--concurrency 1 16 64 256] [--sync-engines 2] [--sync-hidden 512] [--sync-layers 4]
                            [--engine-concurrency 1 8 32] [--sglang-python PATH] [--markdown FILE]

``streaming``: starts the local engine (a tiny 1-layer model, bf16) in a subprocess on 127.0.0.1 and measures:
  * baseline: plain aiohttp, one non-streamed request at a time (no client layer);
  * SGLangClient streaming at 1, 16, 64 and 256 concurrent streams: end-to-end tokens/s and the client's own
    CPU time per streamed token (thread CPU time spent parsing/validating events, around the accumulator);
  * replay: client parsing cost per token of a recorded stream (cumulative and incremental), no network;
  * peak RSS of this (client) process and of the engine process.
``weight-sync``: ``--sync-engines`` engine processes (bf16) serving a larger model; the trainer (this process)
pushes new fp32 weights to all of them, interleaved: from disk (the baseline: ``torch.save`` of the checkpoint +
``/update_weights_from_disk`` on every engine) and over a gloo process group (``/update_weights_from_distributed``,
one flattened bucket per ``--sync-bucket-mb``), each time pause -> update -> flush -> continue.
``engines`` (not in the default sections: it starts a real SGLang server, ~1 GB and ~10 s on 2 cores): the
real SGLang server vs the embedded engine, both started by the trainer's launch interface (``start_engines``: the
SGLang server in its own process group, the embedded engine in this process as the trainer runs it), both in bf16
serving the SAME weights: the trainer's tiny model shape (``TinyGPTArgs``, ``--engine-layers``/``--engine-hidden``)
as the HF OPT checkpoint SGLang serves (``models.tiny_opt``; random init of transformers' ``OPTForCausalLM``), which
the embedded engine serves through transformers' ``OPTForCausalLM`` (eager attention, no KV cache). Measured:
``SGLangClient`` streaming tokens/s at ``--engine-concurrency`` concurrent requests (same prompt, same sampling
params, ``--tokens`` new tokens each), and weight sync ms from disk (checkpoint write + ``/update_weights_from_disk``)
and distributed (gloo), engines and repeats interleaved.
Prints medians over ``--repeats`` runs and ratios to the baseline (``engines``: sglang / embedded).
``--markdown FILE`` also writes each printed table into FILE between its markers (bench/markdown_table.py), one
block per table of the sections run: ``rollout.py`` (streaming), ``rollout.py replay`` (the client's parsing of a
recorded stream), ``rollout.py weight sync``, ``rollout.py engines`` (tokens/s) and ``rollout.py engines sync``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import aiohttp
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from markdown_table import caption_line, write_block  # noqa: E402  # bench/markdown_table.py

import slime_corr.rollout.client as client_mod  # noqa: E402
from slime_corr.engines.embedded.model import create_tiny_checkpoint, load_tiny_lm, save_checkpoint  # noqa: E402
from slime_corr.engines.group import spawn_local_engine  # noqa: E402
from slime_corr.engines.launch import EngineSpec, start_engines  # noqa: E402
from slime_corr.models.hf_checkpoint import load_hf_causal_lm  # noqa: E402
from slime_corr.models.tiny_opt import opt_config, write_opt_checkpoint  # noqa: E402
from slime_corr.rollout import protocol  # noqa: E402
from slime_corr.rollout.client import SGLangClient  # noqa: E402
from slime_corr.rollout.weight_sync import DistributedWeightSync, sync_weights_from_disk  # noqa: E402

PROMPT = list(b"The quick brown fox ")
# a table for --markdown: (block name, what the caption adds, header, rows)
Table = tuple[str, str, list[str], list[list[str]]]


class _Timed(protocol.StreamAccumulator):
    """The client's stream accumulator with a CPU-time counter (the client's per-token work).

    Thread CPU time, not wall time: the engine shares the machine's cores, and its work must not be counted.
    """

    spent = 0.0

    def feed_line(self, data: str) -> None:
        t = time.thread_time()
        try:
            super().feed_line(data)
        finally:
            _Timed.spent += time.thread_time() - t


async def baseline(url: str, n: int, tokens: int) -> float:
    params = {"max_new_tokens": tokens, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        t0, total = time.perf_counter(), 0
        for _ in range(n):
            async with s.post(url + "/generate", json={"input_ids": PROMPT, "sampling_params": params,
                                                       "return_logprob": True}) as r:
                total += len((await r.json())["output_ids"])
        return total / (time.perf_counter() - t0)


async def streamed(url: str, conc: int, tokens: int) -> tuple[float, float]:
    """(tokens/s, client CPU microseconds per token) for ``conc`` concurrent streams."""
    params = {"max_new_tokens": tokens, "ignore_eos": True}
    async with SGLangClient(url, max_concurrency_per_server=max(conc, 1)) as c:
        await c.generate(PROMPT, {"max_new_tokens": 1}, stream=True)  # warm connection
        _Timed.spent = 0.0
        t0 = time.perf_counter()
        res = await asyncio.gather(*(c.generate(PROMPT, params, stream=True) for _ in range(conc)))
        dt = time.perf_counter() - t0
    n = sum(len(r.output_ids) for r in res)
    return n / dt, 1e6 * _Timed.spent / n


async def record(url: str, tokens: int) -> list[str]:
    body = {"input_ids": PROMPT, "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}
    async with aiohttp.ClientSession() as s, s.post(url + "/generate", json=body) as r:
        raw = await r.read()
    return [e[6:].decode() for e in raw.split(b"\n\n") if e.startswith(b"data: ")]


def replay_us_per_token(events: list[str], tokens: int, reps: int = 20) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        acc = protocol.StreamAccumulator()
        for e in events:
            acc.feed_line(e)
        acc.result()
    return 1e6 * (time.perf_counter() - t0) / (reps * tokens)


def peak_rss_mb(who: int = resource.RUSAGE_SELF) -> float:
    return resource.getrusage(who).ru_maxrss / 1024


async def sync_by_disk_and_group(c: SGLangClient, sync: DistributedWeightSync, save: Callable[[str], str],
                                 named: Callable[[], Iterable[tuple[str, torch.Tensor]]], work_dir: str, tag: str
                                 ) -> tuple[float, float]:
    """Seconds of one disk sync (``save`` of the checkpoint + ``/update_weights_from_disk``) and of one
    distributed sync of the same weights, to every engine behind ``c``."""
    t0 = time.perf_counter()
    ckpt = save(os.path.join(work_dir, f"step-{tag}"))
    await sync_weights_from_disk(c, ckpt, f"disk-{tag}")
    disk = time.perf_counter() - t0
    return disk, (await sync.sync(named(), f"dist-{tag}")).seconds


async def weight_sync_runs(urls: list[str], model, work_dir: str, repeats: int, bucket_bytes: int
                           ) -> tuple[list[float], list[float]]:
    """Interleaved (disk, distributed) timings of pushing ``model``'s weights to every engine."""
    disk, group = [], []
    async with SGLangClient(urls) as c:
        sync = DistributedWeightSync(c, bucket_bytes=bucket_bytes)
        try:
            await sync.connect()  # once, as a trainer does; every sync then reuses the group
            for i in range(repeats):
                d, g = await sync_by_disk_and_group(c, sync, lambda path: save_checkpoint(model, path),
                                                    lambda: model.state_dict().items(), work_dir, str(i))
                disk.append(d)
                group.append(g)
        finally:
            sync.close()
    return disk, group


def bench_weight_sync(args: argparse.Namespace) -> list[Table]:
    with tempfile.TemporaryDirectory() as d, contextlib.ExitStack() as stack:
        ckpt = create_tiny_checkpoint(os.path.join(d, "init"), seed=0, hidden_size=args.sync_hidden,
                                      num_layers=args.sync_layers, num_heads=8, ffn_size=4 * args.sync_hidden)
        engines = [stack.enter_context(spawn_local_engine(ckpt, threads=1)) for _ in range(args.sync_engines)]
        model = load_tiny_lm(ckpt)
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        disk, group = asyncio.run(weight_sync_runs([e.url for e in engines], model, d, args.repeats,
                                                   args.sync_bucket_mb * 1024**2))
    md, mg = statistics.median(disk), statistics.median(group)
    print(f"weight sync: {nbytes / 1e6:.1f} MB of fp32 weights ({args.sync_layers} layers, hidden "
          f"{args.sync_hidden}) to {args.sync_engines} bf16 engine process(es); medians of {args.repeats} "
          "interleaved runs (pause -> update -> flush -> continue)")
    print(f"  disk (torch.save + /update_weights_from_disk): {md * 1e3:8.1f} ms   [baseline]")
    print(f"  distributed (gloo broadcast, {args.sync_bucket_mb} MB buckets): {mg * 1e3:8.1f} ms   "
          f"x{md / mg:.2f} faster than disk")
    what = (f"{nbytes / 1e6:.1f} MB of fp32 weights ({args.sync_layers} layers, hidden {args.sync_hidden}) to "
            f"{args.sync_engines} bf16 embedded engine process(es), pause → update → flush → continue; medians of "
            f"{args.repeats} interleaved runs")
    return [("rollout.py weight sync", what, ["weight sync", "ms", "disk / this"],
             [["disk (torch.save + /update_weights_from_disk)", f"{md * 1e3:.1f}", "1.00x"],
              [f"distributed (gloo broadcast, {args.sync_bucket_mb} MB buckets)", f"{mg * 1e3:.1f}",
               f"{md / mg:.2f}x"]])]


def bench_streaming(args: argparse.Namespace) -> list[Table]:
    client_mod.StreamAccumulator = _Timed  # type: ignore[misc]  # count the client's parsing time
    with tempfile.TemporaryDirectory() as d:
        ckpt = create_tiny_checkpoint(d, seed=0, num_layers=1, hidden_size=32, num_heads=2, ffn_size=64)
        with spawn_local_engine(ckpt) as engine:
            url = engine.url
            base = [asyncio.run(baseline(url, args.baseline_requests, args.tokens)) for _ in range(args.repeats)]
            b = statistics.median(base)
            print(f"engine: tiny 1-layer bf16 model in a subprocess at {url}; {args.tokens} tokens/request; "
                  f"medians of {args.repeats} runs")
            print(f"baseline (plain aiohttp, 1 request at a time, non-streamed): {b:9.1f} tok/s")
            print(f"{'streams':>8} {'tok/s':>10} {'x baseline':>10} {'client us/tok':>14} {'peak RSS MB':>12}")
            rows = [["baseline (plain aiohttp, 1 request at a time, non-streamed)", f"{b:.1f}", "1.00", "", ""]]
            for conc in args.concurrency:
                runs = [asyncio.run(streamed(url, conc, args.tokens)) for _ in range(args.repeats)]
                tps = statistics.median(r[0] for r in runs)
                us = statistics.median(r[1] for r in runs)
                print(f"{conc:>8} {tps:>10.1f} {tps / b:>10.2f} {us:>14.1f} {peak_rss_mb():>12.1f}")
                rows.append([f"{conc} concurrent streams", f"{tps:.1f}", f"{tps / b:.2f}", f"{us:.1f}",
                             f"{peak_rss_mb():.1f}"])
            cum_events = asyncio.run(record(url, args.tokens))
        with spawn_local_engine(ckpt, extra_args=["--incremental-streaming-output"]) as engine:
            inc_events = asyncio.run(record(engine.url, args.tokens))
    assert cum_events[-1] == "[DONE]" and inc_events[-1] == "[DONE]"
    cum = replay_us_per_token(cum_events, args.tokens)
    inc = replay_us_per_token(inc_events, args.tokens)
    print(f"replay (client parsing only, {args.tokens}-token stream): cumulative {cum:.1f} us/tok, "
          f"incremental {inc:.1f} us/tok, ratio {cum / inc:.2f}")
    print(f"peak RSS: client process {peak_rss_mb():.1f} MB, engine process {peak_rss_mb(resource.RUSAGE_CHILDREN):.1f} MB")
    what = f"the local engine (a tiny 1-layer bf16 model) in a subprocess on loopback, {args.tokens} tokens/request"
    return [("rollout.py", f"{what}; SGLangClient streaming, medians of {args.repeats} runs",
             ["requests", "tok/s", "x baseline", "client CPU µs / token", "client peak RSS MB"], rows),
            ("rollout.py replay", f"{what}; the client's parsing of one recorded {args.tokens}-token stream, no "
             "network", ["stream", "client µs / token", "x incremental"],
             [["cumulative (SGLang's default)", f"{cum:.1f}", f"{cum / inc:.2f}x"],
              ["incremental (`--incremental-streaming-output`)", f"{inc:.1f}", "1.00x"]])]


ENGINE_KINDS = ("sglang", "embedded")


def tiny_opt_model(args: argparse.Namespace) -> tuple[torch.nn.Module, Any]:
    """The trainer's tiny model shape (``TinyGPTArgs``, changed by ``--engine-*``) as transformers'
    OPTForCausalLM: fp32, random init from the shape's seed."""
    from transformers import OPTConfig, OPTForCausalLM

    from slime_corr.mcore.model import TinyGPTArgs  # imports Megatron: only for this section

    sizes = {"num_layers": args.engine_layers, "hidden_size": args.engine_hidden,
             "num_attention_heads": args.engine_heads}
    shape = TinyGPTArgs(**{k: v for k, v in sizes.items() if v is not None})
    torch.manual_seed(shape.seed)
    config = {k: v for k, v in opt_config(shape).items() if k not in ("architectures", "model_type", "torch_dtype")}
    return OPTForCausalLM(OPTConfig(**config)).eval(), shape


def embedded_opt_module(checkpoint_dir: str) -> torch.nn.Module:
    """The embedded engine's module for an OPT checkpoint: transformers' model, fp32 (the engine casts), no cache."""
    model = load_hf_causal_lm(checkpoint_dir)
    model.config.use_cache = False
    return model


async def engine_sync_runs(urls: dict[str, str], model: torch.nn.Module, shape: Any, work_dir: str,
                           repeats: int, bucket_bytes: int) -> dict[tuple[str, str], list[float]]:
    """{(engine, "disk" | "distributed"): seconds per run}, engines alternating first from one repeat to the next."""
    out: dict[tuple[str, str], list[float]] = {(k, m): [] for k in urls for m in ("disk", "distributed")}
    weights = dict(model.state_dict())  # OPT names, fp32: what the trainer sends an OPT-served tiny model
    async with contextlib.AsyncExitStack() as stack:
        clients = {k: await stack.enter_async_context(SGLangClient(u)) for k, u in urls.items()}
        syncs = {k: DistributedWeightSync(c, bucket_bytes=bucket_bytes) for k, c in clients.items()}
        for s in syncs.values():
            stack.callback(s.close)
            await s.connect()  # once, as a trainer does
        for i in range(repeats):
            for kind in (ENGINE_KINDS if i % 2 == 0 else ENGINE_KINDS[::-1]):
                d, g = await sync_by_disk_and_group(
                    clients[kind], syncs[kind], lambda path: write_opt_checkpoint(weights, shape, path),
                    weights.items, os.path.join(work_dir, kind), str(i))
                out[kind, "disk"].append(d)
                out[kind, "distributed"].append(g)
    return out


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg()) + f" (1/5/15 min) on {os.cpu_count()} cores"


def bench_engines(args: argparse.Namespace) -> list[Table]:
    model, shape = tiny_opt_model(args)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    with tempfile.TemporaryDirectory() as d, contextlib.ExitStack() as stack:
        ckpt = write_opt_checkpoint(dict(model.state_dict()), shape, os.path.join(d, "init"))
        common = {"num_engines": 1, "router": "off", "dtype": args.engine_dtype, "log_dir": Path(d) / "engine_logs"}
        specs = {"sglang": EngineSpec(kind="sglang", sglang_python=args.sglang_python, skip_tokenizer_init=True,
                                      device="cpu", **common),
                 "embedded": EngineSpec(kind="embedded", embedded_module=embedded_opt_module, **common)}
        urls = {k: stack.enter_context(start_engines(specs[k], ckpt, "init")).urls[0] for k in ENGINE_KINDS}
        params = {"max_new_tokens": args.tokens, "ignore_eos": True}
        print(f"engines: real SGLang server ({urls['sglang']}, own process group, CPU defaults of "
              f"engines/sglang_server.py) vs embedded engine ({urls['embedded']}, in this process, transformers' "
              f"OPTForCausalLM, no KV cache); both {args.engine_dtype}, the same fp32 weights: OPT {shape.num_layers} "
              f"layers, hidden {shape.hidden_size}, {shape.num_attention_heads} heads, vocab {shape.vocab_size} "
              f"(the trainer's tiny model shape, random init); SGLangClient streaming, {len(PROMPT)}-token prompt, "
              f"sampling {params}; medians of {args.repeats} interleaved runs; load average {_load()}")
        tps: dict[tuple[str, int], list[float]] = {(k, n): [] for k in ENGINE_KINDS for n in args.engine_concurrency}
        for i in range(args.repeats):
            for conc in args.engine_concurrency:
                for kind in (ENGINE_KINDS if i % 2 == 0 else ENGINE_KINDS[::-1]):
                    tps[kind, conc].append(asyncio.run(streamed(urls[kind], conc, args.tokens))[0])
        print(f"{'streams':>8} {'sglang tok/s':>13} {'embedded tok/s':>15} {'sglang/embedded':>16}")
        streams = []
        for conc in args.engine_concurrency:
            s, e = (statistics.median(tps[k, conc]) for k in ENGINE_KINDS)
            print(f"{conc:>8} {s:>13.1f} {e:>15.1f} {s / e:>16.2f}")
            streams.append([str(conc), f"{s:.1f}", f"{e:.1f}", f"{s / e:.2f}"])
        load_streams = _load()
        runs = asyncio.run(engine_sync_runs(urls, model, shape, d, args.repeats, args.sync_bucket_mb * 1024**2))
    print(f"weight sync of {nbytes / 1e6:.2f} MB of fp32 weights to one engine (pause -> update -> flush -> continue); "
          f"medians of {args.repeats} interleaved runs; load average {_load()}")
    print(f"{'':>13} {'sglang ms':>10} {'embedded ms':>12} {'sglang/embedded':>16}")
    ms = {key: 1e3 * statistics.median(v) for key, v in runs.items()}
    syncs = []
    for method in ("disk", "distributed"):
        s, e = (ms[k, method] for k in ENGINE_KINDS)
        print(f"{method:>13} {s:>10.1f} {e:>12.1f} {s / e:>16.2f}")
        syncs.append([method, f"{s:.1f}", f"{e:.1f}", f"{s / e:.2f}"])
    s, e = (ms[k, "distributed"] / ms[k, "disk"] for k in ENGINE_KINDS)
    print(f"{'dist / disk':>13} {s:>10.2f} {e:>12.2f}")
    syncs.append(["distributed / disk", f"{s:.2f}", f"{e:.2f}", ""])
    print("  disk: safetensors write + /update_weights_from_disk; distributed: gloo broadcast, "
          f"{args.sync_bucket_mb} MB buckets, group built once")
    what = (f"the real SGLang server vs the embedded engine, both {args.engine_dtype}, the same weights (OPT "
            f"{shape.num_layers} layers, hidden {shape.hidden_size}); medians of {args.repeats} interleaved runs")
    return [("rollout.py engines", f"{what}; SGLangClient streaming, {args.tokens} new tokens per request; load "
             f"average {load_streams}", ["concurrent streams", "sglang tok/s", "embedded tok/s", "sglang / embedded"],
             streams),
            ("rollout.py engines sync", f"{what}; {nbytes / 1e6:.2f} MB of fp32 weights to one engine (disk: "
             f"safetensors write + /update_weights_from_disk; distributed: gloo, {args.sync_bucket_mb} MB buckets); "
             f"load average {_load()}", ["weight sync", "sglang ms", "embedded ms", "sglang / embedded"], syncs)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", nargs="+", choices=("streaming", "weight-sync", "engines"),
                    default=["streaming", "weight-sync"], help="engines: real SGLang vs embedded (starts a server)")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline-requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--sync-engines", type=int, default=2, help="engine processes the weights go to")
    ap.add_argument("--sync-hidden", type=int, default=512, help="hidden size of the synced model")
    ap.add_argument("--sync-layers", type=int, default=4, help="layers of the synced model")
    ap.add_argument("--sync-bucket-mb", type=int, default=512, help="bucket size of the distributed sync (MB)")
    ap.add_argument("--engine-concurrency", type=int, nargs="+", default=[1, 8, 32],
                    help="engines: concurrent streams per measurement")
    for flag, what in (("layers", "layers"), ("hidden", "hidden size"), ("heads", "attention heads")):
        ap.add_argument(f"--engine-{flag}", type=int, default=None,
                        help=f"engines: model {what} (default: the trainer's tiny model's, TinyGPTArgs)")
    ap.add_argument("--engine-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="engines: dtype both engines serve in (the main job's --engine-dtype default: bfloat16)")
    ap.add_argument("--sglang-python", default=None,
                    help="engines: the Python with sglang (default: as the trainer finds it, e.g. .venv-sglang/)")
    ap.add_argument("--markdown", metavar="FILE", help="also write each table into FILE between its markers "
                    "(blocks rollout.py, rollout.py replay, rollout.py weight sync, rollout.py engines, "
                    "rollout.py engines sync: those of the sections run)")
    args = ap.parse_args()
    tables: list[Table] = []
    if "streaming" in args.sections:
        tables += bench_streaming(args)
    if "weight-sync" in args.sections:
        tables += bench_weight_sync(args)
    if "engines" in args.sections:
        # SIGTERM (e.g. `timeout`) exits through the context managers: the SGLang server is stopped by its PID
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        tables += bench_engines(args)
    if args.markdown:
        for name, what, header, rows in tables:
            write_block(args.markdown, name, caption_line(sys.argv, "cpu", torch.get_num_threads(), what), header,
                        rows, title=f"The rollout client on loopback (bench/{name})")


if __name__ == "__main__":
    main()
