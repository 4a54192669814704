"""A fault-injection server speaking SGLang's /generate protocol, for the client's fault tests.

It exists because a real SGLang server cannot be made to produce these faults on demand (5xx, 429, a kill
mid-stream, a stream without [DONE], malformed JSON, misaligned or NaN log-probs...). The prompt selects the
behaviour: ``input_ids = [fault_code, n_faulty_attempts, sample_id, ...]``; the first ``n_faulty_attempts``
requests for ``sample_id`` get the fault, later ones a valid answer derived from ``sample_id``.
``served_ok[sample_id]`` counts the valid answers sent in full, so a test can prove no sample was generated twice.

It also plays an OLD SGLang server for the control endpoints (only ``/get_model_info`` and ``/get_server_info``;
``/flush_cache`` answering the statuses queued in ``flush_statuses`` first) - with ``old_router=True`` an old
router (``/add_worker``, ``/list_workers``) - and records every control call in ``calls``: behaviour a current
server cannot be made to show on demand.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator

from aiohttp import web

FAULTS = ["ok", "http500", "http503", "http429", "http400", "timeout", "kill_mid_stream", "no_done",
          "error_event", "error_event_fatal", "malformed_json", "misaligned", "nan", "missing_logprobs",
          "token_mismatch", "abort_503", "close_before_headers", "duplicate_rid"]
CODE = {name: i for i, name in enumerate(FAULTS)}
MODES = ("ok", "ok_then_die", "non_json", "wrong_shape", "http500", "hang_generate", "silent",  # server-wide
         "update_not_json", "update_ignored",  # weight updates answered 200 with a page / success, never applied
         "posts_hang", "gone_after_update")  # the last: killed right after it answered a weight update
WEIGHT_CALLS = ("/update_weights_from_disk", "/init_weights_update_group", "/update_weights_from_distributed")


def closed_port_url() -> str:
    """A loopback URL on which nothing listens (connection refused)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


def good_output(sample_id: int, n: int = 4) -> tuple[list[int], list[float]]:
    ids = [(sample_id * 7 + k) % 250 + 1 for k in range(n)]
    return ids, [-0.1 * (k + 1) for k in range(n)]


def _payload(rid: str, ids: list[int], lps: list, finish: dict | None, total: int | None = None) -> dict:
    return {"text": "", "output_ids": ids, "meta_info": {
        "id": rid, "finish_reason": finish, "prompt_tokens": 3,
        "completion_tokens": len(ids) if total is None else total, "weight_version": "fault",
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids, strict=False)]}}


def _hang_up(request: web.Request) -> web.Response:
    """Close the connection without an answer (the response returned is never sent)."""
    assert request.transport is not None
    request.transport.close()
    return web.Response()


class FaultServer:
    def __init__(self, timeout_sleep: float = 1.0, old_router: bool = False, mode: str | None = None) -> None:
        self.mode = mode  # None: the prompt selects the fault; else one of MODES for every request
        self.die_after = 4  # mode "ok_then_die": /generate requests answered before the server goes away
        self.site: web.TCPSite | None = None
        self.dying = False
        self.gone = False  # mode "gone_after_update": a weight update was answered; nothing answers any more
        self.attempts: Counter[int] = Counter()
        self.served_ok: Counter[int] = Counter()
        self.active = 0  # /generate handlers running now (see wait_idle)
        self.calls: list[tuple[str, dict]] = []  # (path, JSON body or query) of every control call
        self.flush_statuses: list[int] = []  # statuses /flush_cache answers before it answers 200
        self.control_status: dict[str, int] = {}  # a control path -> the error status it answers
        # control paths whose next request on a kept-alive connection finds it closed, unanswered (once each): as
        # when a server closes an idle connection just as a request goes out on it (uvicorn: after 5 s idle)
        self.close_reused: set[str] = set()
        self._requests_on: Counter[int] = Counter()  # requests seen per connection (transport)
        self.rids: list[str] = []
        self.bodies: list[dict] = []  # every /generate and /abort_request body received
        self.timeout_sleep = timeout_sleep
        self.weight_version = "fault"  # what /get_model_info reports (weight updates set it, as in SGLang)
        self.app = web.Application(middlewares=[self._silence])
        self.app.router.add_post("/generate", self.generate)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_post("/abort_request", self.abort)
        router_paths = ("/add_worker", "/list_workers") if old_router else ()
        for path in ("/pause_generation", "/continue_generation", "/flush_cache", "/update_weights_from_disk",
                     "/init_weights_update_group", "/update_weights_from_distributed", *router_paths[:1]):
            self.app.router.add_post(path, self.control)
        for path in ("/get_model_info", "/get_server_info", *router_paths[1:]):
            self.app.router.add_get(path, self.control)

    @web.middleware
    async def _silence(self, request: web.Request, handler):  # noqa: ANN001, ANN202 - aiohttp's middleware
        """Mode "silent": once a /generate came in, nothing answers any more (a stopped process); "posts_hang":
        no POST is ever answered; "gone_after_update": after a weight update, every connection is closed unanswered
        (a process killed between the update and the client's check of its weight version)."""
        if self.gone:
            return _hang_up(request)
        if self.mode == "silent" and self.attempts:
            await asyncio.sleep(3600)
        if self.mode == "posts_hang" and request.method == "POST":  # GETs (health, info) still answer
            await asyncio.sleep(3600)
        return await handler(request)

    async def control(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else dict(request.query)
        self.calls.append((request.path, body))
        self._requests_on[id(request.transport)] += 1
        if request.path in self.close_reused and self._requests_on[id(request.transport)] > 1:
            self.close_reused.discard(request.path)
            return _hang_up(request)
        if request.path in self.control_status:
            return web.json_response({"error": {"message": "injected"}}, status=self.control_status[request.path])
        if request.path == "/flush_cache" and self.flush_statuses:
            return web.json_response({"success": False}, status=self.flush_statuses.pop(0))
        if request.path in WEIGHT_CALLS and self.mode == "update_not_json":  # e.g. a proxy's page
            return web.Response(text="<html>OK</html>", content_type="text/html")
        if request.path in WEIGHT_CALLS and self.mode != "update_ignored" and body.get("weight_version"):
            self.weight_version = body["weight_version"]  # as SGLang: the version the update names
        self.gone = self.gone or (request.path in WEIGHT_CALLS and self.mode == "gone_after_update")
        if request.path == "/get_model_info":
            return web.json_response({"model_path": "fault", "is_generation": True,
                                      "weight_version": self.weight_version})
        if request.path == "/get_server_info":
            return web.json_response({"model_path": "fault", "version": "old"})
        if request.path == "/list_workers":
            return web.json_response({"urls": [b.get("url") for p, b in self.calls if p == "/add_worker"]})
        return web.json_response({"success": True, "message": "ok"})

    @contextlib.contextmanager
    def failing(self, path: str, status: int) -> Iterator[None]:
        """Within the block, the control endpoint ``path`` answers ``status`` with an error body."""
        self.control_status[path] = status
        try:
            yield
        finally:
            self.control_status.pop(path, None)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def abort(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.json())
        return web.json_response({"success": True})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.active += 1
        try:
            return await self._generate(request)
        finally:
            self.active -= 1

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Block the caller's thread until no /generate handler runs, so the counters are final: a client may
        return as soon as it has read [DONE], before the handler that wrote it has counted its answer."""
        deadline = time.monotonic() + timeout
        while self.active:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fault server still busy with {self.active} request(s) after {timeout} s")
            time.sleep(0.005)

    async def _whole_server_mode(self, request: web.Request, body: dict) -> web.StreamResponse:
        """The answer of a server-wide fault (``mode``), whatever the prompt."""
        self.attempts[-1] += 1
        if self.mode == "non_json":  # e.g. a proxy's or another service's page
            return web.Response(text="<html>502 upstream</html>", content_type="text/html")
        if self.mode == "wrong_shape":
            return web.json_response({"choices": [{"text": "hello"}]})
        if self.mode == "http500":
            return web.json_response({"error": "internal"}, status=500)
        if self.mode in ("hang_generate", "silent"):  # /health still answers (hang_generate)
            await asyncio.sleep(3600)
        if self.mode == "ok_then_die" and len(self.rids) > self.die_after:  # the process is gone: refuse
            assert request.transport is not None and self.site is not None
            request.transport.close()
            if not self.dying:
                self.dying = True
                asyncio.get_running_loop().create_task(self.site.stop())
            return web.Response()
        n = int(body.get("sampling_params", {}).get("max_new_tokens", 4))  # mode "ok": a valid answer
        ids, lps = good_output(len(self.rids), max(1, min(4, n)))
        p = _payload(body["rid"], ids, lps, {"type": "length", "length": len(ids)})
        if not body.get("stream"):
            return web.json_response(p)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + json.dumps(p).encode() + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        rid, stream = body["rid"], bool(body.get("stream"))
        self.rids.append(rid)
        if self.mode is not None:
            return await self._whole_server_mode(request, body)
        code, n_bad, sid = body["input_ids"][:3]
        self.attempts[sid] += 1
        fault = FAULTS[code] if self.attempts[sid] <= n_bad else "ok"
        ids, lps = good_output(sid)
        stop = {"type": "stop", "matched": ids[-1]}
        if fault in ("http500", "http503", "http429", "http400"):
            return web.json_response({"error": fault}, status=int(fault[4:]))
        if fault == "duplicate_rid":  # what a worker answers when a router re-sends a rid it is still running
            return web.json_response({"error": f"Duplicate request ID detected: {rid}"}, status=400)
        if fault == "timeout":
            await asyncio.sleep(self.timeout_sleep)
        if fault == "close_before_headers":
            return _hang_up(request)
        if fault == "abort_503":  # an abort carrying a status code: a server-side failure, partial output
            p = _payload(rid, ids[:1], lps[:1], {"type": "abort", "message": "oom", "status_code": 503})
            if not stream:
                return web.json_response(p)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b"data: " + json.dumps(p).encode() + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
            return resp
        if fault == "misaligned":
            lps = lps[:-1]
        if fault == "nan":
            lps = [*lps[:-1], math.nan]
        if not stream:
            if fault == "malformed_json":
                return web.Response(text='{"text": "", "output_ids": [1, 2', content_type="application/json")
            payload = _payload(rid, ids, lps, stop)
            if fault == "token_mismatch":  # output_ids disagree with the log-prob entries' token ids
                payload["output_ids"] = [*ids[:-1], ids[-1] + 1]
            if fault == "missing_logprobs":
                del payload["meta_info"]["output_token_logprobs"]
            if fault == "kill_mid_stream":
                return _hang_up(request)
            if fault == "ok":
                self.served_ok[sid] += 1
            return web.Response(text=json.dumps(payload), content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for k in range(1, len(ids) + 1):
            if fault == "kill_mid_stream" and k == 3:
                assert request.transport is not None
                request.transport.close()
                return resp
            if fault == "malformed_json" and k == 2:
                await resp.write(b'data: {"text": "", "output_ids": [\n\n')
                continue
            if fault in ("error_event", "error_event_fatal") and k == 2:
                err = {"message": "scheduler crashed" if fault == "error_event" else "bad sampling params",
                       "type": "InternalServerError", "code": 500 if fault == "error_event" else 400,
                       "retryable": fault == "error_event"}
                await resp.write(b"data: " + json.dumps({"error": err}).encode() + b"\n\n")
                break
            p = _payload(rid, ids[:k], lps[:k], stop if k == len(ids) else None)
            if fault == "token_mismatch" and k == len(ids):
                p["output_ids"] = [*ids[:-1], ids[-1] + 1]
            if fault == "missing_logprobs":
                del p["meta_info"]["output_token_logprobs"]
            await resp.write(b"data: " + json.dumps(p).encode() + b"\n\n")
        if fault != "no_done":
            await resp.write(b"data: [DONE]\n\n")
        if fault == "ok":  # counted once [DONE] is out: the client may hang up before the final chunk
            self.served_ok[sid] += 1
        await resp.write_eof()
        return resp


@contextlib.contextmanager
def run_fault_server(timeout_sleep: float = 1.0, old_router: bool = False,
                     mode: str | None = None) -> Iterator[tuple[str, FaultServer]]:
    """Serve a :class:`FaultServer` on 127.0.0.1 in a background thread; yields (url, server). Leaving the block
    stops it (later connections are refused)."""
    server = FaultServer(timeout_sleep, old_router, mode)
    loop = asyncio.new_event_loop()
    # handler_cancellation: a handler whose client hung up is cancelled (a stalled answer ends with the client's
    # read timeout, not the stall's length), as SGLang aborts a request whose client disconnected
    runner = web.AppRunner(server.app, handle_signals=False, access_log=None, shutdown_timeout=1.0,
                           handler_cancellation=True)
    ready = threading.Event()
    port: list[int] = []

    def _run() -> None:
        asyncio.set_event_loop(loop)

        async def start() -> None:
            await runner.setup()
            server.site = web.TCPSite(runner, "127.0.0.1", 0)
            await server.site.start()
            port.append(runner.addresses[0][1])

        loop.run_until_complete(start())
        ready.set()
        loop.run_forever()
        pending = asyncio.all_tasks(loop)  # handlers still sleeping (hang modes): cancel them before closing
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()

    t = threading.Thread(target=_run, daemon=True)
    t.start()
    ready.wait(10)
    try:
        yield f"http://127.0.0.1:{port[0]}", server
    finally:
        async def stop() -> None:
            await runner.cleanup()  # closes the listening socket and every open connection
            loop.stop()

        loop.call_soon_threadsafe(lambda: loop.create_task(stop()))
        t.join(10)
