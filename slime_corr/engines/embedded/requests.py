"""The embedded engine's side of ``/generate``'s wire format: a body parsed into requests, a request into the
response object (or stream event) SGLang 0.5.23 sends, and the counters behind ``/metrics``; with the JSON body
reader and the 400 answer every endpoint shares (:class:`BadRequest`, :func:`json_body`, :func:`error_response`).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from aiohttp import web

from slime_corr.engines.embedded.model import EngineModel, Tokenizer
from slime_corr.engines.embedded.routes import check_start_len
from slime_corr.engines.embedded.sampling import request_seed
from slime_corr.rollout.protocol import SAMPLING_KEYS, SAMPLING_MASK_MAX_TOKENS
from slime_corr.routed_experts import encode_routed_experts

# Accepted by the schema but not implemented by this engine: a request using them gets a 400, never a silent no-op.
_UNSUPPORTED = ("stop_regex", "json_schema", "regex", "ebnf", "structural_tag", "beam_width", "watermark", "choice")
# What SGLang's request model (pydantic, lax mode) takes as a boolean
_BOOLS = {"true": True, "t": True, "yes": True, "y": True, "on": True, "1": True,
          "false": False, "f": False, "no": False, "n": False, "off": False, "0": False}


class BadRequest(ValueError):
    """The request violates the protocol: answered with HTTP 400."""


def error_response(message: str, status: int = 400) -> web.Response:
    """SGLang's ``_create_error_response`` body."""
    return web.json_response({"error": {"message": message}}, status=status)


async def json_body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object ({} when there is no body); raises BadRequest otherwise."""
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except ValueError as e:
        raise BadRequest(f"malformed JSON body: {e}") from e
    if not isinstance(body, dict):
        raise BadRequest("expected a JSON object")
    return body


@dataclass
class EngineRequest:
    """One sample being generated: prompt, params, output so far, and how it ended."""

    rid: str
    prompt: list[int]
    params: dict[str, Any]
    return_logprob: bool
    text_in_logprobs: bool
    seed: int
    seeded: bool  # the client gave sampling_seed: computed alone, batch-invariant
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    admitted: bool = True  # False while held: it arrived during a pause and waits for continue_generation
    trim: int | None = None  # text length after trimming a matched stop string
    created: float = field(default_factory=time.perf_counter)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # MoE (`return_routed_experts` on an engine that returns them): each token's experts from the forward that
    # first computed it, [rows, layers, top_k] int32 chunks; rows = prompt + output - 1 once a forward ran
    return_routes: bool = False
    routes_start: int = 0  # routed_experts_start_len
    route_chunks: list[torch.Tensor] = field(default_factory=list)
    route_rows: int = 0
    # `top_logprobs_num` (with return_logprob): per output token the largest log-probs and their ids
    top_logprobs_num: int = 0
    top_logprobs: list[tuple[list[float], list[int]]] = field(default_factory=list)
    # `return_sampling_mask`: per output token its kept set (ids, largest first) and, with `sampling_logprobs_mode`
    # "support", each kept id's log-prob renormalized over the set ("selected": the sampled token's only)
    return_sampling_mask: bool = False
    support_logprobs: bool = False
    kept_ids: list[list[int]] = field(default_factory=list)
    kept_log_probs: list[list[float]] = field(default_factory=list)

    def finish_with(self, reason: dict[str, Any]) -> None:
        if self.finish is None:
            self.finish = reason
            if not self.admitted:  # aborted while waiting (held, or retracted by a pause): SGLang returns no routes
                self.route_chunks.clear()
        self.changed.set()

    def add_routes(self, rows: torch.Tensor) -> None:
        """The routes of the rows a forward computed first (those after ``route_rows``)."""
        self.route_chunks.append(rows)
        self.route_rows += rows.shape[0]

    def routed_experts(self) -> str | None:
        """``meta_info.routed_experts`` of the finished request: rows ``[routes_start, prompt + output - 1)``, or
        None when it was not asked for, is not finished, or never ran a forward."""
        if not self.return_routes or self.finish is None or not self.route_chunks:
            return None
        end = len(self.prompt) + len(self.output_ids) - 1
        return encode_routed_experts(torch.cat(self.route_chunks)[self.routes_start : end])

    def add_support(self, token: int, ids: list[int], log_probs: list[float]) -> None:
        """The kept set of the token just sampled, as SGLang returns it for this request's logprobs mode."""
        self.kept_ids.append(ids)
        self.kept_log_probs.append(log_probs if self.support_logprobs else [log_probs[ids.index(token)]])

    def text(self, tokenizer: Tokenizer, ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=bool(self.params.get("skip_special_tokens", True)))


@dataclass
class EngineStats:
    """Counters behind ``/metrics`` and ``/v1/loads``, and the last finished requests (rid -> finish type)."""

    requests: int = 0
    aborted: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: collections.OrderedDict[str, str] = field(default_factory=collections.OrderedDict)
    _recent: collections.deque[tuple[float, int]] = field(default_factory=lambda: collections.deque(maxlen=256))

    def record_step(self, tokens: int) -> None:
        self.generation_tokens += tokens
        self._recent.append((time.monotonic(), tokens))

    def record_finish(self, req: EngineRequest) -> None:
        kind = (req.finish or {}).get("type", "abort")
        self.aborted += kind == "abort"
        self.finished[req.rid] = kind
        while len(self.finished) > 10_000:
            self.finished.popitem(last=False)

    def throughput(self, window: float = 5.0) -> float:
        now = time.monotonic()
        return sum(n for t, n in self._recent if now - t <= window) / window


def parse_generate(body: Any, model: EngineModel, tokenizer: Tokenizer, active: Mapping[str, EngineRequest],
                   rid_tag: str = "local", routes_enabled: bool = False) -> tuple[list[EngineRequest], bool, bool]:
    """Validate a /generate body; returns (requests, is_batch, stream). Raises BadRequest naming the field.

    ``routes_enabled``: the engine returns MoE routes (SGLang's ``--enable-return-routed-experts``); without it
    ``return_routed_experts`` is ignored, as SGLang does. A ``routed_experts_start_len`` outside ``[0, prompt]``
    fails its request with SGLang's 400 (a request finished before it runs)."""
    if not isinstance(body, dict):
        raise BadRequest("invalid type: expected struct GenerateRequest")
    input_ids, text = body.get("input_ids"), body.get("text")
    if input_ids is None and text is None:
        raise BadRequest("Either text or input_ids should be provided.")
    if input_ids is None:
        texts = text if isinstance(text, list) else [text]
        prompts, is_batch = [tokenizer.encode(str(t)) for t in texts], isinstance(text, list)
    else:
        is_batch = bool(input_ids) and isinstance(input_ids[0], list)
        prompts = input_ids if is_batch else [input_ids]
    n = len(prompts)
    stream = bool(body.get("stream", False))
    if stream and is_batch:
        raise BadRequest("streaming a batch is not supported by the local engine")
    sp = body.get("sampling_params") or {}
    sps = sp if isinstance(sp, list) else [sp] * n
    rids = body.get("rid")
    rids = rids if isinstance(rids, list) else [rids] * n if rids is not None else [None] * n
    if len(sps) != n or len(rids) != n:
        raise BadRequest("rid / sampling_params list length must match the number of prompts")
    ret_lp = body.get("return_logprob") or False
    ret_lps = ret_lp if isinstance(ret_lp, list) else [ret_lp] * n
    lp_start = body.get("logprob_start_len")
    if lp_start not in (None, -1) or body.get("token_ids_logprob"):
        raise BadRequest("only output log-probs are supported (logprob_start_len=-1, no token_ids_logprob)")
    top = body.get("top_logprobs_num")
    tops = top if isinstance(top, list) else [top] * n
    if len(tops) != n:
        raise BadRequest("top_logprobs_num list length must match the number of prompts")
    want_routes = _lax_bool(body.get("return_routed_experts", False), "return_routed_experts")
    want_mask = _lax_bool(body.get("return_sampling_mask", False) or False, "return_sampling_mask")
    mode = body.get("sampling_logprobs_mode")
    if mode not in (None, "selected", "support"):
        raise BadRequest("sampling_logprobs_mode: Input should be 'selected' or 'support'")
    if mode is not None and not want_mask:
        raise BadRequest("sampling_logprobs_mode can only be set when return_sampling_mask=true.")
    start_len = body.get("routed_experts_start_len", 0)
    if not isinstance(start_len, int):
        raise BadRequest("routed_experts_start_len: Input should be a valid integer")
    reqs = []
    for prompt, params, rid, rlp, num in zip(prompts, sps, rids, ret_lps, tops, strict=True):
        check_request(params, prompt, model)
        num = _top_logprobs_num(num, model.vocab_size)
        if rid is None:
            rid = f"{rid_tag}-{time.monotonic_ns()}-{len(active)}-{len(reqs)}"
        if rid in active or any(r.rid == rid for r in reqs):
            raise BadRequest(f"Duplicate request ID detected: {rid}")
        req = EngineRequest(rid, list(prompt), dict(params), bool(rlp), bool(body.get("return_text_in_logprobs")),
                            request_seed(params), params.get("sampling_seed") is not None,
                            return_routes=want_routes and routes_enabled, routes_start=int(start_len),
                            top_logprobs_num=num if rlp else 0, return_sampling_mask=want_mask,
                            support_logprobs=mode == "support")
        error = check_start_len(int(start_len), len(prompt)) if want_routes else None
        error = error or (sampling_mask_error(params) if want_mask else None)
        if error is not None:
            req.finish = {"type": "abort", "message": error, "status_code": 400, "err_type": "BadRequestError"}
        reqs.append(req)
    return reqs, is_batch, stream


def sampling_mask_error(params: dict[str, Any]) -> str | None:
    """SGLang 0.5.23's refusal of a sampling mask (its message), or None: the mask needs top_k = 1 (greedy sampling
    counts as top_k 1) or a finite 1 < top_k <= --sampling-mask-max-tokens (4096)."""
    greedy = float(params.get("temperature", 1.0)) < 1e-6
    top_k = 1 if greedy else int(params.get("top_k") or -1)
    top_k = 1 << 30 if top_k <= 0 else top_k  # SGLang's "off"
    if top_k == 1 or 1 < top_k <= SAMPLING_MASK_MAX_TOKENS:
        return None
    return (f"return_sampling_mask requires top_k=1 for greedy sampling or finite 1 < top_k <= "
            f"{SAMPLING_MASK_MAX_TOKENS}; got top_k={top_k}. Lower top_k or increase --sampling-mask-max-tokens.")


def _top_logprobs_num(value: Any, vocab_size: int) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequest(f"top_logprobs_num: expected an integer >= 0, got {value!r}")
    if value > vocab_size:
        raise BadRequest(f"top_logprobs_num {value} > the vocabulary's {vocab_size} tokens")
    return value


def _lax_bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _BOOLS:
        return _BOOLS[value.lower()]
    raise BadRequest(f"{name}: Input should be a valid boolean")


def check_request(params: Any, prompt: Any, model: EngineModel) -> None:
    """One prompt and its sampling params against the schema and the model (vocabulary, context)."""
    if not isinstance(params, dict):
        raise BadRequest("invalid type: expected struct SamplingParams")
    for k in params:
        if k not in SAMPLING_KEYS:
            raise BadRequest(f"unknown field `{k}` in sampling_params")
        if k in _UNSUPPORTED and params[k] not in (None, [], {}):
            raise BadRequest(f"sampling_params.{k} is not supported by the local engine")
    if int(params.get("n", 1) or 1) != 1:
        raise BadRequest("sampling_params.n > 1 is not supported: send one request per sample")
    if not prompt or not all(isinstance(t, int) and 0 <= t < model.vocab_size for t in prompt):
        raise BadRequest(f"input_ids must be non-empty ints in [0, {model.vocab_size})")
    if len(prompt) >= model.max_seq_len:
        raise BadRequest(f"prompt length {len(prompt)} >= max context length {model.max_seq_len}")
    temperature = params.get("temperature", 1.0)
    if temperature is None or float(temperature) < 0:
        raise BadRequest("temperature must be >= 0")
    seed = params.get("sampling_seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest(f"sampling_params.sampling_seed must be an integer, got {seed!r}")


def response_payload(req: EngineRequest, tokenizer: Tokenizer, weight_version: str, start: int = 0) -> dict[str, Any]:
    """The response object for ``req``; ``start`` > 0 gives an incremental (delta) stream event."""
    if start:
        text = req.text(tokenizer, req.output_ids[start:])
    else:
        text = req.text(tokenizer, req.output_ids)
        if req.trim is not None:
            text = text[: req.trim]
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish,
        "prompt_tokens": len(req.prompt),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": 0,
        "weight_version": req.versions[-1] if req.versions else weight_version,
        "e2e_latency": time.perf_counter() - req.created,
    }
    if req.return_logprob:
        meta["output_token_logprobs"] = [
            [lp, tok, req.text(tokenizer, [tok]) if req.text_in_logprobs else None]
            for lp, tok in zip(req.logprobs[start:], req.output_ids[start:], strict=True)
        ]
        if req.top_logprobs_num:
            meta["output_top_logprobs"] = [
                [[v, t, req.text(tokenizer, [t]) if req.text_in_logprobs else None] for v, t in zip(*top, strict=True)]
                for top in req.top_logprobs[start:]
            ]
    if req.return_sampling_mask:  # cumulative, or from `start` in a delta stream, like the log-probs
        meta["output_token_sampling_mask"] = req.kept_ids[start:]
        meta["output_token_sampling_logprobs"] = req.kept_log_probs[start:]
        meta["output_token_sampling_mask_length"] = len(req.kept_ids)
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(req.versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    if len(spans) > 1:
        meta["weight_versions"] = spans
    routes = req.routed_experts()  # with the finishing event only, the whole request's in a delta stream too
    if routes is not None:
        meta["routed_experts"] = routes
    return {"text": text, "output_ids": req.output_ids[start:], "meta_info": meta}
