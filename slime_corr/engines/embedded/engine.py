"""An embedded engine that speaks SGLang 0.5.23's HTTP protocol on 127.0.0.1, serving a real small causal LM.

Used when no SGLang URL is given (laptops, CI). ``/generate`` (POST or PUT) takes token ids or ``text`` (encoded
by the engine's tokenizer, byte-level by default), returns log-probs, streams SSE cumulative or incremental, and
serves batches of prompts (the wire format: :mod:`.requests`); the control endpoints (abort, pause /
continue, flush, weight updates from disk or over a process group, load / metrics / readiness for
sglang-router) live in :mod:`.control`.

Scheduling: every active request advances one token per step; a step runs the model on the batch (right-padded,
no KV cache: the tiny model recomputes the prefix) in a worker thread. A request with ``sampling_seed`` is
computed in a forward of its own and draws its tokens by (seed, position) (:mod:`.sampling`): its output does
not depend on what it was batched with or when it ran. Log-probs follow SGLang: ``log_softmax(logits / T)`` of
the sampled token, not renormalised after top-p/top-k/min-p filtering; ``T == 0`` is greedy with the raw
``log_softmax(logits)``; ``top_logprobs_num`` returns the largest of the same log-probs
(``meta_info.output_top_logprobs``); ``return_sampling_mask`` returns each token's kept set and its log-probs
renormalized over it (``meta_info.output_token_sampling_mask`` / ``_logprobs``, SGLang 0.5.23's fields and rules:
:mod:`.requests`). The matched stop token / EOS stays in ``output_ids`` and the log-probs; only
``text`` is trimmed. Requests arriving during a pause (or while memory is released) wait until generation continues.
A Mixture-of-Experts model returns ``meta_info.routed_experts`` as SGLang 0.5.23 does (:mod:`.routes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from aiohttp import web

from slime_corr.engines.embedded.control import HOLD_PAUSE, add_control_routes
from slime_corr.engines.embedded.model import (
    ByteTokenizer,
    EngineModel,
    Tokenizer,
    TorchEngineModel,
    create_tiny_checkpoint,
    eos_ids,
)
from slime_corr.engines.embedded.requests import (
    BadRequest,
    EngineRequest,
    EngineStats,
    parse_generate,
    response_payload,
)
from slime_corr.engines.embedded.routes import routes_enabled
from slime_corr.engines.embedded.sampling import position_generator, sample_token, top_log_probs
from slime_corr.threads import inference_thread

# one request's step: (token, its log-prob, the MoE routes computed first, the top log-probs (values, ids) asked for)
# (token, log-prob, MoE routes, top log-probs, (kept ids, their support log-probs)), the last three when asked
StepResult = tuple[int, float, torch.Tensor | None, tuple[list[float], list[int]] | None,
                   tuple[list[int], list[float]] | None]


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
        tokenizer: Tokenizer | None = None,
        group_timeout: float = 600.0,
        enable_return_routed_experts: bool = False,
    ) -> None:
        self.model = model
        self.return_routes = routes_enabled(model, enable_return_routed_experts)
        self.tokenizer: Tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.step_delay = step_delay  # seconds slept after each step: throttles generation for demos / tests
        self.model_path = model_path
        self.served_model_name = served_model_name
        self.incremental = incremental_streaming_output
        self.max_running = max_running_requests
        self.weight_version = weight_version
        self.group_timeout = group_timeout  # seconds a weight-update group waits for its peers
        self.host, self.port = "127.0.0.1", 0
        self.active: dict[str, EngineRequest] = {}
        self.holds: set[str] = set()  # reasons new requests are held (pause, released memory)
        self.released: set[str] = set()  # memory tags released by /release_memory_occupation
        self.stats = EngineStats()
        self.serving = False
        self._wake: asyncio.Event | None = None
        self._step_lock: asyncio.Lock | None = None
        self._task: asyncio.Task | None = None
        self.app = web.Application()
        self.app.on_startup.append(self._on_startup)
        self.app.on_cleanup.append(self._on_cleanup)
        for method in ("POST", "PUT"):
            self.app.router.add_route(method, "/generate", self.handle_generate)
        self.control = add_control_routes(self, self.app.router)

    # ---- state shared with the control plane --------------------------------------------------------
    @property
    def step_lock(self) -> asyncio.Lock:
        assert self._step_lock is not None, "engine not started"
        return self._step_lock

    @property
    def paused(self) -> bool:
        return HOLD_PAUSE in self.holds

    def busy(self) -> bool:
        """Requests are running (held ones do not count: they own no cache)."""
        return any(r.finish is None and r.admitted for r in self.active.values())

    def abort(self, rid: str, abort_all: bool, message: str, admitted_only: bool = False) -> None:
        """SGLang 0.5.23's abort: ``abort_all``, or an exact rid this engine knows (then every rid it prefixes)."""
        if not abort_all and rid not in self.active:
            return
        for req in list(self.active.values()):
            if (abort_all or req.rid.startswith(rid)) and (req.admitted or not admitted_only):
                req.finish_with({"type": "abort", "message": message})

    def release_hold(self, reason: str) -> None:
        """Drop one reason to hold requests; when none is left, held requests are admitted."""
        self.holds.discard(reason)
        if not self.holds:
            for req in self.active.values():
                req.admitted = True
            if self._wake is not None:
                self._wake.set()

    # ---- lifecycle -------------------------------------------------------------------------------------
    async def _on_startup(self, app: web.Application) -> None:
        self._wake = asyncio.Event()
        self._step_lock = asyncio.Lock()
        self._task = asyncio.create_task(self._scheduler())
        self.serving = True

    async def _on_cleanup(self, app: web.Application) -> None:
        self.serving = False
        for req in list(self.active.values()):
            req.finish_with({"type": "abort", "message": "server shutting down", "status_code": 503})
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.control.close()

    # ---- scheduler -------------------------------------------------------------------------------------
    async def _scheduler(self) -> None:
        assert self._wake is not None
        while True:
            runnable = [r for r in self.active.values() if r.finish is None and r.admitted]
            if self.holds or not runnable:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = runnable[: self.max_running]
            async with self.step_lock:
                try:
                    results = await asyncio.to_thread(self._step, batch)
                except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the server
                    for req in batch:
                        req.finish_with({"type": "abort", "message": f"engine error: {e!r}", "status_code": 500,
                                         "err_type": "InternalServerError"})
                    continue
            version = self.weight_version
            for req, (tok, lp, routes, top, support) in zip(batch, results, strict=True):
                if req.finish is not None:  # aborted while the step ran: the token is discarded
                    continue
                if routes is not None:
                    req.add_routes(routes)
                req.output_ids.append(tok)
                req.logprobs.append(lp)
                if top is not None:
                    req.top_logprobs.append(top)
                if support is not None:
                    req.add_support(tok, *support)
                req.versions.append(version)
                self._check_finish(req, tok)
                req.changed.set()
            self.stats.record_step(len(batch))
            await asyncio.sleep(self.step_delay)  # let handlers run between steps

    @torch.inference_mode()
    def _step(self, batch: list[EngineRequest]) -> list[StepResult]:
        with inference_thread():  # a trainer in this process keeps its Megatron scratch state (mcore/threads.py)
            return self._step_forwards(batch)

    def _step_forwards(self, batch: list[EngineRequest]) -> list[StepResult]:
        """One token for each request: unseeded ones share a padded forward, seeded ones get one each. With the
        token and its log-prob, the MoE routes of the rows this forward computed first for a request that asked
        for them (the whole sequence at its first step, then its last token), else None, the top log-probs
        (values, ids) of a request that asked for them, else None, and its kept set with the support log-probs
        (`return_sampling_mask`), else None."""
        rows: dict[int, torch.Tensor] = {}
        new_routes: dict[int, torch.Tensor] = {}
        shared = [i for i, r in enumerate(batch) if not r.seeded]
        groups = [shared] if shared else []
        groups += [[i] for i, r in enumerate(batch) if r.seeded]
        for idx in groups:
            seqs = [batch[i].prompt + batch[i].output_ids for i in idx]
            last, routes = self._forward(seqs, any(batch[i].return_routes for i in idx))
            if routes is not None:
                for j, i in enumerate(idx):
                    if batch[i].return_routes:
                        new_routes[i] = routes[j, batch[i].route_rows : len(seqs[j])].to("cpu", copy=True)
            rows.update(zip(idx, last.cpu().unbind(0), strict=True))  # one transfer; sampling draws on the CPU
        out = []
        for i, req in enumerate(batch):
            row = rows[i]
            if len(req.output_ids) < int(req.params.get("min_new_tokens", 0) or 0):
                for t in self._stop_ids(req):
                    row[t] = -math.inf
            for t, bias in (req.params.get("logit_bias") or {}).items():
                row[int(t)] += float(bias)
            position = len(req.prompt) + len(req.output_ids)
            tok, logp, kept_ids, kept_log_probs = sample_token(row, req.params, position_generator(req.seed, position),
                                                               with_support=req.return_sampling_mask)
            top = top_log_probs(logp, req.top_logprobs_num) if req.top_logprobs_num else None
            support = (kept_ids, kept_log_probs) if req.return_sampling_mask else None
            out.append((tok, float(logp[tok]), new_routes.get(i), top, support))
        return out

    def _forward(self, seqs: list[list[int]], with_routes: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One right-padded forward of `seqs` on the model's device: float32 logits of each sequence's last token
        `[n, V]` (a new tensor, there), and with `with_routes` the MoE routes `[n, T, layers, top_k]`."""
        device, width = self.model.device, max(len(s) for s in seqs)
        ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs], dtype=torch.long, device=device)
        routes = None
        if with_routes:
            logits, routes = self.model.logits_and_routes(ids)  # type: ignore[attr-defined]
        else:
            logits = self.model.logits(ids)
        last = torch.tensor([len(s) - 1 for s in seqs], device=device)
        return logits[torch.arange(len(seqs), device=device), last].float(), routes

    def _stop_ids(self, req: EngineRequest) -> set[int]:
        ids = {int(t) for t in req.params.get("stop_token_ids") or []}
        if not req.params.get("ignore_eos", False):
            ids |= eos_ids(self.model.eos_token_id, self.tokenizer.eos_token_id)
        return ids

    def _check_finish(self, req: EngineRequest, tok: int) -> None:
        p = req.params
        if tok in self._stop_ids(req):
            req.finish = {"type": "stop", "matched": tok}
            return
        stops = p.get("stop") or []
        if isinstance(stops, str):
            stops = [stops]
        if stops:
            text = req.text(self.tokenizer, req.output_ids)
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

    # ---- handlers -------------------------------------------------------------------------------------
    async def handle_generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
            reqs, is_batch, stream = parse_generate(body, self.model, self.tokenizer, self.active,
                                                   f"local-{self.port}", self.return_routes)
        except (BadRequest, ValueError, TypeError, KeyError, IndexError) as e:
            return web.json_response({"error": str(e)}, status=400)
        for req in reqs:  # like SGLang, a request that arrives during a pause waits for continue_generation
            req.admitted = not self.holds
            self.active[req.rid] = req
            self.stats.requests += 1
            self.stats.prompt_tokens += len(req.prompt)
        assert self._wake is not None
        self._wake.set()
        try:
            if stream:
                return await self._stream(request, reqs[0])
            for req in reqs:
                await self._wait_finished(request, req)
            out = [response_payload(r, self.tokenizer, self.weight_version) for r in reqs]
            status = next((r.finish.get("status_code") for r in reqs if r.finish and r.finish.get("status_code")), 200)
            if status != 200:
                return web.json_response({"error": {"message": reqs[0].finish.get("message", ""), "code": status}},
                                         status=status)
            return web.json_response(out if is_batch else out[0])
        finally:
            for req in reqs:
                req.finish_with({"type": "abort", "message": "client disconnected"})
                self.stats.record_finish(req)
                self.active.pop(req.rid, None)

    async def _wait_finished(self, request: web.Request, req: EngineRequest) -> None:
        while req.finish is None:
            req.changed.clear()
            try:
                await asyncio.wait_for(req.changed.wait(), 0.2)
            except TimeoutError:
                if request.transport is None or request.transport.is_closing():
                    req.finish_with({"type": "abort", "message": "client disconnected"})

    async def _stream(self, request: web.Request, req: EngineRequest) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        interval = int(req.params.get("stream_interval") or 1)
        sent = 0
        try:
            await resp.prepare(request)  # the client may be gone already (cancelled at a Ctrl-C)
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
                    start = sent if self.incremental else 0
                    payload = response_payload(req, self.tokenizer, self.weight_version, start)
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


@dataclass
class LocalEngineHandle:
    """A running local engine: its base ``url`` and the :class:`LocalEngine` (for tests and metrics)."""

    url: str
    engine: LocalEngine
    checkpoint_dir: str


class _DropH2Probes(logging.Filter):
    """sglang-router first probes a worker with gRPC (HTTP/2); aiohttp logs each probe as an error: drop those."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "PRI/Upgrade" not in str(record.exc_info[1] if record.exc_info else record.getMessage())


logging.getLogger("aiohttp.server").addFilter(_DropH2Probes())


@contextlib.contextmanager
def start_local_engine(
    checkpoint_dir: str | None = None,
    *,
    model: EngineModel | None = None,
    tokenizer: Tokenizer | None = None,
    dtype: torch.dtype = torch.bfloat16,
    incremental_streaming_output: bool = False,
    weight_version: str = "default",
    max_running_requests: int = 256,
    seed: int = 0,
    step_delay: float = 0.0,
    served_model_name: str = "slime-corr-tiny",
    group_timeout: float = 600.0,
    enable_return_routed_experts: bool = False,
    host: str = "127.0.0.1",
) -> Iterator[LocalEngineHandle]:
    """Serve a local engine on `host` (default 127.0.0.1; a free port) in a background thread; stops it on exit.

    ``checkpoint_dir`` None creates a fresh tiny checkpoint (seed ``seed``) in a temporary directory.
    ``model`` overrides the default :class:`TorchEngineModel` (e.g. a Megatron or Hugging Face model adapter),
    ``tokenizer`` the byte-level one. ``enable_return_routed_experts`` (SGLang's ``--enable-return-routed-experts``):
    True returns MoE routes when asked (a dense model raises, as SGLang fails to start), False (SGLang's default)
    ignores ``return_routed_experts``.
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
                         max_running_requests=max_running_requests, step_delay=step_delay, tokenizer=tokenizer,
                         served_model_name=served_model_name, group_timeout=group_timeout,
                         enable_return_routed_experts=enable_return_routed_experts)
    loop = asyncio.new_event_loop()
    # an engine that stops drops its requests: no wait for their handlers (aiohttp's default is 60 s, longer than
    # torchrun's 30 s between its SIGINT to a job's ranks and its SIGKILL)
    runner = web.AppRunner(engine.app, handle_signals=False, access_log=None, shutdown_timeout=1.0)
    started = threading.Event()
    error: list[BaseException] = []

    async def _start() -> None:
        await runner.setup()
        site = web.TCPSite(runner, host, 0)
        await site.start()
        engine.host, engine.port = host, runner.addresses[0][1]

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
        yield LocalEngineHandle(f"http://{host}:{engine.port}", engine, checkpoint_dir or "")
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        if tmp is not None:
            tmp.cleanup()


def main(argv: list[str] | None = None) -> None:
    """``python -m slime_corr.engines.embedded.engine [--checkpoint DIR] [--fp32]``: serve until interrupted.

    Prints ``READY <url>`` on stdout once listening on 127.0.0.1 (or `--host`).
    """
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--checkpoint", default=None, help="checkpoint dir (default: a fresh tiny model)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the fresh tiny model (no --checkpoint)")
    ap.add_argument("--fp32", action="store_true", help="serve in fp32 instead of bf16")
    ap.add_argument("--incremental-streaming-output", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    ap.add_argument("--step-delay", type=float, default=0.0, help="seconds slept after each decode step")
    ap.add_argument("--weight-version", default="default")
    ap.add_argument("--host", default="127.0.0.1", help="the address it listens on (one its clients reach)")
    ap.add_argument("--group-timeout", type=float, default=600.0,
                    help="seconds a weight-update group waits for its peers")
    ap.add_argument("--enable-return-routed-experts", dest="routes", action="store_true",
                    help="return the MoE routes a request asks for (return_routed_experts), as SGLang's flag")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with start_local_engine(args.checkpoint, dtype=torch.float32 if args.fp32 else torch.bfloat16,
                            incremental_streaming_output=args.incremental_streaming_output, seed=args.seed,
                            step_delay=args.step_delay, weight_version=args.weight_version,
                            group_timeout=args.group_timeout, enable_return_routed_experts=args.routes,
                            host=args.host) as h:
        print(f"READY {h.url}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()


if __name__ == "__main__":
    main()
