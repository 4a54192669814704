"""An embedded engine that speaks SGLang 0.5.23's HTTP protocol on 127.0.0.1, serving a real small causal LM.

Used when no SGLang URL is given (laptops, CI). It implements the endpoints an RL trainer uses: ``/generate``
(token ids in/out, ``return_logprob``, streaming SSE cumulative or incremental, batches of prompts),
``/abort_request`` (rid prefix match), ``/pause_generation`` + ``/continue_generation`` (requests arriving
during a pause wait for continue, as in SGLang), ``/flush_cache`` (400 while requests run),
``/update_weights_from_disk``, ``/update_weight_version``, health and model/server info.

Scheduling: every active request advances one token per step; a step runs the model on the whole batch
(right-padded, no KV cache: the tiny model recomputes the prefix) in a worker thread. Log-probs follow SGLang:
``log_softmax(logits / temperature)`` of the sampled token, not renormalised after top-p/top-k/min-p
filtering (applied in SGLang's order); with ``temperature == 0`` decoding is greedy and the log-prob is
``log_softmax(logits)`` (raw).
The matched stop token / EOS stays in ``output_ids`` and the log-probs; only ``text`` is trimmed.
The distributed weight-update calls need NCCL/GPUs and answer 400 here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from aiohttp import web

from slime_corr.rollout.engine_model import EngineModel, TorchEngineModel, create_tiny_checkpoint
from slime_corr.rollout.protocol import SAMPLING_KEYS

# Accepted by the schema but not implemented by this engine: a request using them gets a 400, never a silent no-op.
_UNSUPPORTED = ("stop_regex", "json_schema", "regex", "ebnf", "structural_tag", "beam_width", "watermark", "choice")
VERSION = "0.5.23-slime-corr-local"


class BadRequest(ValueError):
    """The request violates the protocol: answered with HTTP 400 ``{"error": ...}``."""


def detokenize(ids: list[int]) -> str:
    """Byte-level detokenizer of the default model (ids >= 256 are dropped)."""
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def sample_next_token(
    logits: torch.Tensor, params: dict[str, Any], generator: torch.Generator | None
) -> tuple[int, float]:
    """Sample one token from float32 ``logits`` [V] with SGLang's semantics; returns (token, log-prob)."""
    temperature = float(params.get("temperature", 1.0))
    if temperature < 1e-6:  # greedy; log-prob of the raw logits
        tok = int(torch.argmax(logits))
        return tok, float(torch.log_softmax(logits, dim=-1)[tok])
    logp = torch.log_softmax(logits / temperature, dim=-1)
    # SGLang's filter, on the probabilities sorted once: top-p on the cumulative sum of the FULL distribution,
    # top-k by rank, min-p relative to the largest probability; then sample among what is left.
    sorted_p, order = torch.sort(logp.exp(), descending=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    top_p = float(params.get("top_p", 1.0))
    if top_p < 1.0:
        keep &= (torch.cumsum(sorted_p, 0) - sorted_p) <= top_p
    top_k = int(params.get("top_k", -1) or -1)
    if 0 < top_k < sorted_p.numel():
        keep[top_k:] = False
    min_p = float(params.get("min_p", 0.0))
    if min_p > 0.0:
        keep &= sorted_p >= sorted_p[0] * min_p
    tok = int(order[torch.multinomial(torch.where(keep, sorted_p, 0.0), 1, generator=generator)])
    return tok, float(logp[tok])  # NOT renormalised after filtering


@dataclass
class _Request:
    rid: str
    prompt: list[int]
    params: dict[str, Any]
    return_logprob: bool
    text_in_logprobs: bool
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    admitted: bool = True  # False while held: it arrived during a pause and waits for continue_generation
    trim: int | None = None  # text length after trimming a matched stop string
    created: float = field(default_factory=time.perf_counter)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def finish_with(self, reason: dict[str, Any]) -> None:
        if self.finish is None:
            self.finish = reason
        self.changed.set()


class LocalEngine:
    """The HTTP app and scheduler. Build it, then serve ``engine.app`` (see :func:`start_local_engine`)."""

    def __init__(
        self,
        model: EngineModel,
        model_path: str = "",
        served_model_name: str = "slime-corr-tiny",
        incremental_streaming_output: bool = False,
        max_running_requests: int = 256,
        weight_version: str = "default",
        step_delay: float = 0.0,
    ) -> None:
        self.model = model
        self.step_delay = step_delay  # seconds slept after each step: throttles generation for demos / tests
        self.model_path = model_path
        self.served_model_name = served_model_name
        self.incremental = incremental_streaming_output
        self.max_running = max_running_requests
        self.weight_version = weight_version
        self.host, self.port = "127.0.0.1", 0
        self.active: dict[str, _Request] = {}
        self.paused = False
        self._wake: asyncio.Event | None = None
        self._step_lock: asyncio.Lock | None = None
        self._seed_counter = 0
        self._task: asyncio.Task | None = None
        self.app = web.Application()
        self.app.on_startup.append(self._on_startup)
        self.app.on_cleanup.append(self._on_cleanup)
        r = self.app.router
        r.add_post("/generate", self.handle_generate)
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.handle_health)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.handle_model_info)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.handle_server_info)
        r.add_post("/abort_request", self.handle_abort)
        r.add_post("/pause_generation", self.handle_pause)
        r.add_post("/continue_generation", self.handle_continue)
        r.add_post("/flush_cache", self.handle_flush)
        r.add_get("/flush_cache", self.handle_flush)
        r.add_post("/update_weights_from_disk", self.handle_update_from_disk)
        r.add_post("/update_weight_version", self.handle_update_weight_version)
        for path in ("/init_weights_update_group", "/update_weights_from_distributed", "/update_weights_from_tensor"):
            r.add_post(path, self.handle_unsupported)

    # ---- lifecycle -------------------------------------------------------------------------------------
    async def _on_startup(self, app: web.Application) -> None:
        self._wake = asyncio.Event()
        self._step_lock = asyncio.Lock()
        self._task = asyncio.create_task(self._scheduler())

    async def _on_cleanup(self, app: web.Application) -> None:
        for req in list(self.active.values()):
            req.finish_with({"type": "abort", "message": "server shutting down", "status_code": 503})
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # ---- scheduler -------------------------------------------------------------------------------------
    async def _scheduler(self) -> None:
        assert self._wake is not None and self._step_lock is not None
        while True:
            runnable = [r for r in self.active.values() if r.finish is None and r.admitted]
            if self.paused or not runnable:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = runnable[: self.max_running]
            async with self._step_lock:
                try:
                    results = await asyncio.to_thread(self._step, batch)
                except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the server
                    for req in batch:
                        req.finish_with({"type": "abort", "message": f"engine error: {e!r}", "status_code": 500,
                                         "err_type": "InternalServerError"})
                    continue
            version = self.weight_version
            for req, (tok, lp) in zip(batch, results, strict=True):
                if req.finish is not None:  # aborted while the step ran: the token is discarded
                    continue
                req.output_ids.append(tok)
                req.logprobs.append(lp)
                req.versions.append(version)
                self._check_finish(req, tok)
                req.changed.set()
            await asyncio.sleep(self.step_delay)  # let handlers run between steps

    @torch.inference_mode()
    def _step(self, batch: list[_Request]) -> list[tuple[int, float]]:
        seqs = [r.prompt + r.output_ids for r in batch]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
        logits = self.model.logits(ids)
        out = []
        for i, req in enumerate(batch):
            row = logits[i, len(seqs[i]) - 1].float().clone()
            if len(req.output_ids) < int(req.params.get("min_new_tokens", 0) or 0):
                for t in self._stop_ids(req):
                    row[t] = -math.inf
            for t, bias in (req.params.get("logit_bias") or {}).items():
                row[int(t)] += float(bias)
            out.append(sample_next_token(row, req.params, req.generator))
        return out

    def _stop_ids(self, req: _Request) -> set[int]:
        ids = set(req.params.get("stop_token_ids") or [])
        if self.model.eos_token_id is not None and not req.params.get("ignore_eos", False):
            ids.add(int(self.model.eos_token_id))
        return ids

    def _check_finish(self, req: _Request, tok: int) -> None:
        p = req.params
        if tok in self._stop_ids(req):
            req.finish = {"type": "stop", "matched": tok}
            return
        stops = p.get("stop") or []
        if isinstance(stops, str):
            stops = [stops]
        if stops:
            text = detokenize(req.output_ids)
            for s in stops:
                pos = text.find(s) if s else -1
                if pos >= 0:
                    req.finish = {"type": "stop", "matched": s}
                    req.trim = None if p.get("no_stop_trim") else pos
                    return
        max_new = p.get("max_new_tokens", 128)
        if max_new is not None and len(req.output_ids) >= int(max_new):
            req.finish = {"type": "length", "length": len(req.output_ids)}
        elif len(req.prompt) + len(req.output_ids) >= self.model.max_seq_len:
            req.finish = {"type": "length", "length": len(req.output_ids)}

    # ---- request parsing ------------------------------------------------------------------------------
    def _parse(self, body: Any) -> tuple[list[_Request], bool, bool]:
        """Validate a /generate body; returns (requests, is_batch, stream)."""
        if not isinstance(body, dict):
            raise BadRequest("invalid type: expected struct GenerateRequest")
        input_ids, text = body.get("input_ids"), body.get("text")
        if input_ids is None and text is None:
            raise BadRequest("Either text or input_ids should be provided.")
        if input_ids is None:
            texts = text if isinstance(text, list) else [text]
            prompts, is_batch = [list(str(t).encode()) for t in texts], isinstance(text, list)
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
        if lp_start not in (None, -1) or body.get("top_logprobs_num") or body.get("token_ids_logprob"):
            raise BadRequest("only output log-probs are supported (logprob_start_len=-1, no top_logprobs)")
        reqs = []
        for prompt, params, rid, rlp in zip(prompts, sps, rids, ret_lps, strict=True):
            if not isinstance(params, dict):
                raise BadRequest("invalid type: expected struct SamplingParams")
            for k in params:
                if k not in SAMPLING_KEYS:
                    raise BadRequest(f"unknown field `{k}` in sampling_params")
                if k in _UNSUPPORTED and params[k] not in (None, [], {}):
                    raise BadRequest(f"sampling_params.{k} is not supported by the local engine")
            if int(params.get("n", 1) or 1) != 1:
                raise BadRequest("sampling_params.n > 1 is not supported: send one request per sample")
            if not prompt or not all(isinstance(t, int) and 0 <= t < self.model.vocab_size for t in prompt):
                raise BadRequest(f"input_ids must be non-empty ints in [0, {self.model.vocab_size})")
            if len(prompt) >= self.model.max_seq_len:
                raise BadRequest(f"prompt length {len(prompt)} >= max context length {self.model.max_seq_len}")
            temperature = params.get("temperature", 1.0)
            if temperature is None or float(temperature) < 0:
                raise BadRequest("temperature must be >= 0")
            if rid is None:
                rid = f"local-{os.getpid()}-{time.monotonic_ns()}-{len(self.active)}"
            if rid in self.active or any(r.rid == rid for r in reqs):
                raise BadRequest(f"Duplicate request ID: {rid}")
            gen = torch.Generator()
            seed = params.get("sampling_seed")
            if seed is None:
                self._seed_counter += 1
                seed = hash((os.getpid(), time.monotonic_ns(), self._seed_counter)) & 0x7FFFFFFF
            gen.manual_seed(int(seed))
            reqs.append(_Request(rid, list(prompt), dict(params), bool(rlp),
                                 bool(body.get("return_text_in_logprobs")), gen))
        return reqs, is_batch, stream

    # ---- response building ----------------------------------------------------------------------------
    def _payload(self, req: _Request, start: int = 0) -> dict[str, Any]:
        """The response object for ``req``; ``start`` > 0 gives an incremental (delta) stream event."""
        text = detokenize(req.output_ids)
        if req.trim is not None:
            text = text[: req.trim]
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finish,
            "prompt_tokens": len(req.prompt),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": 0,
            "weight_version": req.versions[-1] if req.versions else self.weight_version,
            "e2e_latency": time.perf_counter() - req.created,
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = [
                [lp, tok, detokenize([tok]) if req.text_in_logprobs else None]
                for lp, tok in zip(req.logprobs[start:], req.output_ids[start:], strict=True)
            ]
        spans: list[dict[str, Any]] = []
        for i, v in enumerate(req.versions):
            if spans and spans[-1]["version"] == v:
                spans[-1]["end"] = i + 1
            else:
                spans.append({"version": v, "start": i, "end": i + 1})
        if len(spans) > 1:
            meta["weight_versions"] = spans
        if start:
            text = detokenize(req.output_ids[start:])
        return {"text": text, "output_ids": req.output_ids[start:], "meta_info": meta}

    # ---- handlers -------------------------------------------------------------------------------------
    async def handle_generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
            reqs, is_batch, stream = self._parse(body)
        except (BadRequest, ValueError, TypeError, KeyError, IndexError) as e:
            return web.json_response({"error": str(e)}, status=400)
        for req in reqs:  # like SGLang, a request that arrives during a pause waits for continue_generation
            req.admitted = not self.paused
            self.active[req.rid] = req
        assert self._wake is not None
        self._wake.set()
        try:
            if stream:
                return await self._stream(request, reqs[0])
            for req in reqs:
                await self._wait_finished(request, req)
            out = [self._payload(r) for r in reqs]
            status = next((r.finish.get("status_code") for r in reqs if r.finish and r.finish.get("status_code")), 200)
            if status != 200:
                return web.json_response({"error": {"message": reqs[0].finish.get("message", ""), "code": status}},
                                         status=status)
            return web.json_response(out if is_batch else out[0])
        finally:
            for req in reqs:
                req.finish_with({"type": "abort", "message": "client disconnected"})
                self.active.pop(req.rid, None)

    async def _wait_finished(self, request: web.Request, req: _Request) -> None:
        while req.finish is None:
            req.changed.clear()
            try:
                await asyncio.wait_for(req.changed.wait(), 0.5)
            except TimeoutError:
                if request.transport is None or request.transport.is_closing():
                    req.finish_with({"type": "abort", "message": "client disconnected"})

    async def _stream(self, request: web.Request, req: _Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        interval = int(req.params.get("stream_interval") or 1)
        sent = 0
        try:
            while True:
                req.changed.clear()
                done = req.finish is not None
                n = len(req.output_ids)
                if done and req.finish and req.finish.get("status_code"):  # a server-side error, as SGLang sends it
                    code = int(req.finish["status_code"])
                    err = {"message": req.finish.get("message", ""), "type": req.finish.get("err_type", "Error"),
                           "code": code, "retryable": code >= 500}
                    await resp.write(b"data: " + json.dumps({"error": err}).encode() + b"\n\n")
                    break
                if n - sent >= interval or done:
                    payload = self._payload(req, start=sent if self.incremental else 0)
                    await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
                    sent = n
                if done:
                    break
                await req.changed.wait()
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionResetError, ConnectionError):
            req.finish_with({"type": "abort", "message": "client disconnected"})
        return resp

    async def handle_health(self, request: web.Request) -> web.Response:
        ok = self._task is not None and not self._task.done()
        return web.Response(status=200 if ok else 503)

    def _model_info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
                "served_model_name": self.served_model_name, "preferred_sampling_params": None,
                "weight_version": self.weight_version, "load_format": "torch"}

    async def handle_model_info(self, request: web.Request) -> web.Response:
        return web.json_response(self._model_info())

    async def handle_server_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path, "served_model_name": self.served_model_name,
            "tokenizer_path": self.model_path, "max_context_length": int(self.model.max_seq_len),
            "version": VERSION, "host": self.host, "port": self.port,
            "incremental_streaming_output": self.incremental, "disaggregation_mode": "null",
            "max_running_requests": self.max_running, "weight_version": self.weight_version,
            "internal_states": [{"paused": self.paused, "num_running": len(self.active)}],
        })

    async def _json_body(self, request: web.Request) -> dict[str, Any]:
        if not request.can_read_body:
            return {}
        body = await request.json()
        if not isinstance(body, dict):
            raise BadRequest("expected a JSON object")
        return body

    async def handle_abort(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        rid, abort_all = body.get("rid", ""), bool(body.get("abort_all", False))
        for req in list(self.active.values()):
            if abort_all or (rid and req.rid.startswith(rid)):  # SGLang matches by prefix
                req.finish_with({"type": "abort", "message": "Abort request"})
        return web.json_response({"success": True})

    async def handle_pause(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return web.json_response({"error": f"unknown pause mode {mode!r}"}, status=400)
        self.paused = True
        assert self._step_lock is not None
        async with self._step_lock:  # wait for the running step to finish
            if mode == "abort":
                for req in [r for r in self.active.values() if r.admitted]:
                    req.finish_with({"type": "abort", "message": "Abort by pause_generation"})
        return web.json_response({"success": True, "message": f"Generation paused ({mode})."})

    async def handle_continue(self, request: web.Request) -> web.Response:
        self.paused = False
        for req in self.active.values():
            req.admitted = True
        assert self._wake is not None
        self._wake.set()
        return web.json_response({"success": True, "message": "Generation continued."})

    async def handle_flush(self, request: web.Request) -> web.Response:
        if any(r.finish is None and r.admitted for r in self.active.values()):  # held requests hold no cache
            return web.json_response({"success": False, "message": "Cache not flushed: requests in flight."},
                                     status=400)
        return web.json_response({"success": True, "message": "Cache flushed."})

    async def handle_update_from_disk(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request)
            path = body["model_path"]
        except (BadRequest, ValueError, KeyError) as e:
            return web.json_response({"success": False, "message": f"bad request: {e}"}, status=400)
        assert self._step_lock is not None
        async with self._step_lock:
            try:
                await asyncio.to_thread(self.model.load_checkpoint, path)
            except Exception as e:  # noqa: BLE001 - reported to the caller, the old weights stay
                return web.json_response({"success": False, "message": f"Failed to update weights: {e}"},
                                         status=400)
            self.model_path = path
            if body.get("weight_version") is not None:
                self.weight_version = str(body["weight_version"])
        return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                                  "num_paused_requests": 0})

    async def handle_update_weight_version(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        self.weight_version = str(body.get("new_version", self.weight_version))
        return web.json_response({"success": True, "message": f"weight_version={self.weight_version}"})

    async def handle_unsupported(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"success": False, "message": f"{request.path} needs NCCL and GPUs; the local engine supports "
                                          "/update_weights_from_disk only"}, status=400)


@dataclass
class LocalEngineHandle:
    """A running local engine: its base ``url`` and the :class:`LocalEngine` (for tests and metrics)."""

    url: str
    engine: LocalEngine
    checkpoint_dir: str


@contextlib.contextmanager
def start_local_engine(
    checkpoint_dir: str | None = None,
    *,
    model: EngineModel | None = None,
    dtype: torch.dtype = torch.bfloat16,
    incremental_streaming_output: bool = False,
    weight_version: str = "default",
    max_running_requests: int = 256,
    seed: int = 0,
    step_delay: float = 0.0,
) -> Iterator[LocalEngineHandle]:
    """Serve a local engine on 127.0.0.1 (a free port) in a background thread; stops it on exit.

    ``checkpoint_dir`` None creates a fresh tiny checkpoint (seed ``seed``) in a temporary directory.
    ``model`` overrides the default :class:`TorchEngineModel` (e.g. a Megatron model adapter).
    """
    tmp = None
    if checkpoint_dir is None and model is None:
        tmp = tempfile.TemporaryDirectory(prefix="slime_corr_engine_")
        checkpoint_dir = create_tiny_checkpoint(tmp.name, seed=seed)
    if model is None:
        assert checkpoint_dir is not None
        model = TorchEngineModel(checkpoint_dir, dtype=dtype)
    engine = LocalEngine(model, model_path=checkpoint_dir or "", weight_version=weight_version,
                         incremental_streaming_output=incremental_streaming_output,
                         max_running_requests=max_running_requests, step_delay=step_delay)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(engine.app, handle_signals=False, access_log=None)
    started = threading.Event()
    error: list[BaseException] = []

    async def _start() -> None:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        engine.port = runner.addresses[0][1]

    def _run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(_start())
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            error.append(e)
            started.set()
            return
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=_run, name="slime-corr-local-engine", daemon=True)
    thread.start()
    started.wait()
    if error:
        raise error[0]
    try:
        yield LocalEngineHandle(f"http://127.0.0.1:{engine.port}", engine, checkpoint_dir or "")
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        if tmp is not None:
            tmp.cleanup()


def main(argv: list[str] | None = None) -> None:
    """``python -m slime_corr.rollout.local_engine [--checkpoint DIR] [--fp32]``: serve until interrupted.

    Prints ``READY <url>`` on stdout once listening on 127.0.0.1.
    """
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--checkpoint", default=None, help="checkpoint dir (default: a fresh tiny model)")
    ap.add_argument("--fp32", action="store_true", help="serve in fp32 instead of bf16")
    ap.add_argument("--incremental-streaming-output", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    ap.add_argument("--step-delay", type=float, default=0.0, help="seconds slept after each decode step")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with start_local_engine(args.checkpoint, dtype=torch.float32 if args.fp32 else torch.bfloat16,
                            incremental_streaming_output=args.incremental_streaming_output,
                            step_delay=args.step_delay) as h:
        print(f"READY {h.url}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()


if __name__ == "__main__":
    main()
