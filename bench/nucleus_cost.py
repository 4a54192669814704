"""Cost of reading the engine's own nucleus (`--rollout-nucleus-logprobs`, `slime_corr.rollout.nucleus`): the extra
bytes per token on the wire and the client's extra time, against the same requests without `top_logprobs_num`.

Run: `python bench/nucleus_cost.py [--tokens 64] [--top 5 20 64] [--repeats 20] [--rows 4096]
[--markdown docs/benchmarks.md]` (`--markdown FILE` also writes the three tables there: blocks `nucleus_cost.py`
(wire), `nucleus_cost.py parse` and `nucleus_cost.py mass`; bench/markdown_table.py).
  * wire: the embedded engine (fp32, the tiny model; SGLang's JSON format, `skip_tokenizer_init`-style null texts)
    answers the same seeded request (`--tokens` new tokens, top_p 0.9) with top_logprobs_num 0 and each `--top`:
    bytes of the non-streamed body per token, and of every event of a cumulative and an incremental stream
    (stream_interval 1: a cumulative stream re-sends everything so far, O(T²)).
  * parse: `json.loads` + `parse_generate_response` of the recorded bodies with and without the nucleus read (checks
    + the mass), per token, interleaved medians (bench/timing.py), ratio to the plain parse.
  * mass: `engine_nucleus` alone on [`--rows`, N] float64 top-N log-probs (a rollout's tokens at once), per token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import aiohttp
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from markdown_table import caption_line, write_block  # noqa: E402  # bench/markdown_table.py
from timing import interleaved_medians  # noqa: E402

from slime_corr.engines.embedded.engine import start_local_engine  # noqa: E402
from slime_corr.rollout.nucleus import NucleusRequest, engine_nucleus  # noqa: E402
from slime_corr.rollout.protocol import parse_generate_response  # noqa: E402

PROMPT = list(b"hello world: ")
TOP_P = 0.9
Table = tuple[list[str], list[list[str]]]  # (header, rows) of a markdown table


async def _raw(url: str, body: dict) -> bytes:
    async with aiohttp.ClientSession() as s, s.post(url + "/generate", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.read()


def _body(tokens: int, top: int, stream: bool) -> dict:
    body = {"input_ids": PROMPT, "return_logprob": True, "stream": stream,
            "sampling_params": {"max_new_tokens": tokens, "temperature": 1.0, "top_p": TOP_P, "ignore_eos": True,
                                "sampling_seed": 3}}
    if top:
        body["top_logprobs_num"] = top
    return body


def wire_table(tokens: int, tops: list[int]) -> tuple[dict[int, bytes], Table]:
    """Bytes per token of each response shape; returns the non-streamed bodies by top_logprobs_num and the table."""
    sizes: dict[str, dict[int, int]] = {"plain": {}, "cumulative stream": {}, "incremental stream": {}}
    bodies: dict[int, bytes] = {}
    for incremental in (False, True):
        with start_local_engine(dtype=torch.float32, incremental_streaming_output=incremental) as h:
            for top in [0, *tops]:
                if not incremental:
                    bodies[top] = asyncio.run(_raw(h.url, _body(tokens, top, False)))
                    sizes["plain"][top] = len(bodies[top])
                name = "incremental stream" if incremental else "cumulative stream"
                sizes[name][top] = len(asyncio.run(_raw(h.url, _body(tokens, top, True))))
    tokens = len(json.loads(bodies[0])["output_ids"])  # (the tiny model's context may end the response first)
    print(f"wire: bytes per response token, {tokens} tokens, top_p {TOP_P} (extra over top_logprobs_num 0)")
    header = ["response, bytes / token", "N=0", *(f"N={top} (extra, x N=0)" for top in tops)]
    rows = []
    for name, by_top in sizes.items():
        base = by_top[0] / tokens
        cells = "  ".join(f"N={top}: {n / tokens:8.0f} (+{n / tokens - base:6.0f}, x{n / by_top[0]:.1f})"
                          for top, n in by_top.items() if top)
        print(f"  {name:19s} N=0: {base:6.0f}   {cells}")
        rows.append([name, f"{base:.0f}", *(f"{n / tokens:.0f} (+{n / tokens - base:.0f}, x{n / by_top[0]:.1f})"
                                            for top, n in by_top.items() if top)])
    return bodies, (header, rows)


def parse_table(bodies: dict[int, bytes], repeats: int) -> Table:
    objs = {top: json.loads(raw) for top, raw in bodies.items()}
    tokens = len(objs[0]["output_ids"])
    runs = {"plain parse (N=0)": lambda: parse_generate_response(json.loads(bodies[0]))}
    for top in objs:
        if top:
            request = NucleusRequest(TOP_P, -1, top)
            runs[f"nucleus read N={top}"] = lambda top=top, request=request: parse_generate_response(
                json.loads(bodies[top]), nucleus=request)
    fits = {top: sum(x == x for x in parse_generate_response(objs[top], nucleus=NucleusRequest(TOP_P, -1, top))
                     .nucleus_log_mass) / tokens for top in objs if top}
    times = interleaved_medians(runs, repeats)
    base = times["plain parse (N=0)"]
    print(f"parse: client time per token, json.loads + checks + the mass (median of {repeats})")
    rows = []
    for name, t in times.items():
        top = int(name.split("N=")[1].rstrip(")"))
        share = f"   fits {fits[top]:.0%}" if top else ""
        print(f"  {name:20s} {t / tokens * 1e6:8.2f} us/token   x{t / base:.1f}{share}")
        rows.append([name, f"{t / tokens * 1e6:.2f}", f"{t / base:.1f}x", f"{fits[top]:.0%}" if top else ""])
    return ["client parse", "µs / token", "x plain parse", "tokens on the engine path (fits)"], rows


def mass_table(rows: int, tops: list[int], repeats: int) -> Table:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, 4096, generator=g) * 3
    lp = torch.log_softmax(logits, -1)
    runs = {}
    for top in tops:
        values, ids = lp.topk(top, -1)
        values = values.double()
        sampled = ids[:, 0]
        runs[f"N={top}"] = lambda v=values, i=ids, s=sampled: engine_nucleus(v, i, s, v[:, 0], top_p=TOP_P, top_k=-1)
    times = interleaved_medians(runs, repeats)
    print(f"mass: engine_nucleus on [{rows}, N] (median of {repeats})")
    for name, t in times.items():
        print(f"  {name:8s} {t * 1e3:8.3f} ms   {t / rows * 1e9:7.1f} ns/token")
    return (["engine_nucleus (the mass)", f"ms per [{rows}, N]", "µs / token"],
            [[name, f"{t * 1e3:.3f}", f"{t / rows * 1e6:.3f}"] for name, t in times.items()])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--top", type=int, nargs="+", default=[5, 20, 64])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--markdown", metavar="FILE", help="also write the three tables into FILE between their markers "
                    "(blocks nucleus_cost.py, nucleus_cost.py parse, nucleus_cost.py mass)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    bodies, wire = wire_table(args.tokens, args.top)
    parse = parse_table(bodies, args.repeats)
    mass = mass_table(args.rows, args.top, args.repeats)
    if args.markdown:
        tokens = len(json.loads(bodies[0])["output_ids"])
        what = {"nucleus_cost.py": f"the embedded engine (fp32, the tiny model), {tokens}-token responses, top_p "
                                   f"{TOP_P}; N = top_logprobs_num",
                "nucleus_cost.py parse": f"`json.loads` + `parse_generate_response` of the {tokens}-token bodies, "
                                         f"interleaved medians of {args.repeats}",
                "nucleus_cost.py mass": f"`engine_nucleus` alone on [{args.rows}, N] float64 top-N log-probs, "
                                        f"interleaved medians of {args.repeats}"}
        for (name, extra), (header, rows) in zip(what.items(), (wire, parse, mass), strict=True):
            write_block(args.markdown, name, caption_line(sys.argv, "cpu", 1, extra), header, rows,
                        title=f"Reading the engine's nucleus (bench/{name})")


if __name__ == "__main__":
    main()
