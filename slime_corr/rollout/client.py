"""Async client for SGLang servers (or an sglang-router): /generate with log-probs, control and weight sync.

Faults and retries (one request per sample, every call ends exactly once: a result or a GenerationError):

======================================  =========================================================
what happened                           what the client does
======================================  =========================================================
connection refused / reset, broken      retry with backoff + jitter and a NEW rid (SGLang rejects a
stream, stream ended without [DONE]     reused in-flight rid; a dropped connection aborts the old one)
timeout                                 best-effort /abort_request of the old rid, then retry (the
                                        server may still be generating it: it must not run twice)
HTTP 429, 408, 5xx; abort with a 5xx    retry
HTTP 400 / other 4xx                    fail at once (the request is wrong; retrying cannot help)
error event in a stream                 retry if the event says ``retryable`` (or code 5xx/429), else fail
malformed JSON, missing / misaligned /  retry: the response is unusable, nothing reached a sample, and a
NaN log-probs, inconsistent stream      fresh sample from the same policy is still on-policy; NaN never
                                        reaches a sample
abort without status (abort / pause)    returned as a result with ``finish_type == "abort"`` and the partial
                                        output; the driver (:mod:`.rollout`) applies the pause policy
======================================  =========================================================

After ``RetryPolicy.max_attempts`` attempts the call raises :class:`GenerationError` with the last reason.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import secrets
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from slime_corr.rollout.protocol import (
    GenerateOutput,
    ResponseError,
    StreamAccumulator,
    StreamErrorEvent,
    build_generate_request,
    parse_generate_response,
)

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class GenerationError(Exception):
    """A /generate call that ended without a usable result; ``reason`` says why, ``attempts`` how many tries.

    ``maybe_running``: the server may still be generating the request (a timeout): abort its rid before retrying.
    """

    def __init__(self, reason: str, retryable: bool = False, attempts: int = 0, maybe_running: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retryable = retryable
        self.attempts = attempts
        self.maybe_running = maybe_running


@dataclass
class RetryPolicy:
    """Bounded exponential backoff with jitter."""

    max_attempts: int = 4
    base_delay: float = 0.05
    max_delay: float = 2.0
    jitter: float = 0.5

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt`` (1-based)."""
        d = min(self.max_delay, self.base_delay * 2 ** (attempt - 1))
        return d * (1.0 + self.jitter * random.random())


@dataclass
class GenerateResult(GenerateOutput):
    """A finished /generate call: the validated output plus the rid, server and attempts used."""

    server: str = ""
    attempts: int = 1
    errors: list[str] = field(default_factory=list)


class SGLangClient:
    """Talks to one or more SGLang servers (or one router URL) with bounded concurrency per server.

    Use as ``async with SGLangClient(urls) as client: ...``. Request ids are fixed-width and unique
    (``{prefix}-{counter:012d}`` with a random 8-character per-client prefix) because SGLang's abort matches
    by prefix: no rid is a prefix of another, and ``abort(rid=client.rid_prefix)`` aborts exactly this client's.
    """

    def __init__(
        self,
        urls: str | list[str],
        max_concurrency_per_server: int = 64,
        request_timeout: float = 600.0,
        connect_timeout: float = 10.0,
        read_timeout: float | None = 120.0,
        retry: RetryPolicy | None = None,
        rid_prefix: str | None = None,
    ) -> None:
        self.urls = [u.rstrip("/") for u in ([urls] if isinstance(urls, str) else urls)]
        if not self.urls:
            raise ValueError("urls: at least one server URL is required")
        self.max_concurrency = max_concurrency_per_server
        self.timeout = aiohttp.ClientTimeout(total=request_timeout, sock_connect=connect_timeout,
                                             sock_read=read_timeout)
        self.retry = retry or RetryPolicy()
        self.rid_prefix = rid_prefix or secrets.token_hex(4)
        if len(self.rid_prefix) != 8 or not self.rid_prefix.isalnum() or not self.rid_prefix.isascii():
            raise ValueError(f"rid_prefix: must be 8 ASCII letters/digits (fixed width, as SGLang's abort matches "
                             f"rids by prefix), got {self.rid_prefix!r}")
        self._counter = itertools.count()
        self._sems = {u: asyncio.Semaphore(max_concurrency_per_server) for u in self.urls}
        self._load: dict[str, int] = dict.fromkeys(self.urls, 0)  # requests assigned (queued or in flight)
        self._rr = itertools.count()
        self._session: aiohttp.ClientSession | None = None
        self._running: asyncio.Event | None = None  # cleared between pause() and continue_generation()
        self._background: set[asyncio.Task] = set()  # best-effort aborts still running

    # ---- session ---------------------------------------------------------------------------------------
    async def __aenter__(self) -> SGLangClient:
        self._get_session()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            n = self.max_concurrency
            connector = aiohttp.TCPConnector(limit=n * len(self.urls) + 8, limit_per_host=n + 4)
            self._session = aiohttp.ClientSession(timeout=self.timeout, connector=connector)
        return self._session

    async def close(self) -> None:
        """Close the HTTP session (after the pending best-effort aborts, at most a few seconds)."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=5.0)
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _running_event(self) -> asyncio.Event:
        if self._running is None:
            self._running = asyncio.Event()
            self._running.set()
        return self._running

    def new_rid(self) -> str:
        """A fresh fixed-width request id (never a prefix of another one from this client)."""
        return f"{self.rid_prefix}-{next(self._counter):012d}"

    def _pick_server(self, avoid: str | None = None) -> str:
        """Least loaded server (round-robin among ties), avoiding ``avoid`` when there is a choice."""
        cands = [u for u in self.urls if u != avoid] or self.urls
        start = next(self._rr) % len(cands)
        cands = cands[start:] + cands[:start]
        return min(cands, key=lambda u: self._load[u])

    # ---- generation ------------------------------------------------------------------------------------
    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any] | None = None,
        *,
        stream: bool = False,
        return_logprob: bool = True,
    ) -> GenerateResult:
        """Generate one sample from token ids; retries safe faults; raises :class:`GenerationError`."""
        build_generate_request(input_ids, sampling_params, "check", stream, return_logprob)  # fail fast
        errors: list[str] = []
        server: str | None = None
        for attempt in range(1, self.retry.max_attempts + 1):
            server = self._pick_server(avoid=server)
            rid = self.new_rid()
            body = build_generate_request(input_ids, sampling_params, rid, stream, return_logprob)
            self._load[server] += 1  # counted while queued on the semaphore too, so new work goes elsewhere
            try:
                async with self._sems[server]:
                    await self._running_event().wait()  # nothing is sent between our pause() and continue
                    out = await self._attempt(server, body, stream, return_logprob)
                return GenerateResult(**vars(out), server=server, attempts=attempt, errors=errors)
            except GenerationError as e:
                errors.append(f"attempt {attempt} ({rid} @ {server}): {e.reason}")
                if not e.retryable:
                    raise GenerationError(e.reason, False, attempt) from e
                if e.maybe_running:
                    task = asyncio.ensure_future(self._quiet_abort(server, rid))
                    self._background.add(task)
                    task.add_done_callback(self._background.discard)
            finally:
                self._load[server] -= 1
            if attempt < self.retry.max_attempts:
                await asyncio.sleep(self.retry.delay(attempt))  # backoff with jitter; the next try gets a new rid
        raise GenerationError(f"gave up after {self.retry.max_attempts} attempts; " + "; ".join(errors),
                              False, self.retry.max_attempts)

    async def _attempt(self, server: str, body: dict[str, Any], stream: bool, want_lp: bool) -> GenerateOutput:
        """One HTTP attempt, with every failure mapped to a GenerationError(retryable=...)."""
        session = self._get_session()
        try:
            async with session.post(f"{server}/generate", json=body) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:300]
                    raise GenerationError(f"HTTP {resp.status}: {text}", resp.status in RETRYABLE_STATUS)
                if stream:
                    out = await self._read_stream(resp, want_lp)
                else:
                    try:
                        obj = json.loads(await resp.read())
                    except (json.JSONDecodeError, UnicodeDecodeError) as e:
                        raise ResponseError(f"response: malformed JSON ({e})") from e
                    out = parse_generate_response(obj, want_lp)
        except GenerationError:
            raise
        except ResponseError as e:
            raise GenerationError(f"bad response: {e}", retryable=True) from e
        except StreamErrorEvent as e:
            raise GenerationError(str(e), retryable=e.retryable) from e
        except TimeoutError as e:
            raise GenerationError(f"timeout ({e!r})", retryable=True, maybe_running=True) from e
        except aiohttp.ClientConnectorError as e:
            raise GenerationError(f"connection failed: {e}", retryable=True) from e
        except (aiohttp.ClientError, ConnectionError) as e:  # disconnects, payload errors, resets
            raise GenerationError(f"connection broken: {e!r}", retryable=True) from e
        fr = out.finish_reason or {}
        if fr.get("type") == "abort" and fr.get("status_code"):
            code = int(fr["status_code"])
            raise GenerationError(f"aborted by server with status {code}: {fr.get('message')}",
                                  code in RETRYABLE_STATUS)
        return out

    async def _read_stream(self, resp: aiohttp.ClientResponse, want_lp: bool) -> GenerateOutput:
        acc = StreamAccumulator(want_lp)
        buf = b""
        async for chunk in resp.content.iter_any():
            buf += chunk
            while True:
                sep = buf.find(b"\n\n")
                if sep < 0:
                    break
                event, buf = buf[:sep], buf[sep + 2 :]
                for line in event.decode("utf-8", errors="replace").splitlines():
                    line = line.strip()
                    if line.startswith("data:"):
                        acc.feed_line(line[5:].strip())
            if acc.done:
                break
        return acc.result()

    async def _quiet_abort(self, server: str, rid: str) -> None:
        try:
            await self._post(server, "/abort_request", {"rid": rid}, timeout=5.0)
        except Exception:  # noqa: BLE001 - best effort: the server also aborts on disconnect
            pass

    # ---- control endpoints ----------------------------------------------------------------------------
    async def _post(self, server: str, path: str, payload: dict[str, Any] | None = None,
                    timeout: float | None = None) -> tuple[int, Any]:
        session = self._get_session()
        kw: dict[str, Any] = {"json": payload if payload is not None else {}}
        if timeout is not None:
            kw["timeout"] = aiohttp.ClientTimeout(total=timeout)
        async with session.post(f"{server}{path}", **kw) as resp:
            return resp.status, await _body(resp)

    async def _get(self, server: str, path: str) -> tuple[int, Any]:
        async with self._get_session().get(f"{server}{path}") as resp:
            return resp.status, await _body(resp)

    async def _post_all(self, path: str, payload: dict[str, Any] | None = None) -> list[Any]:
        results = await asyncio.gather(*(self._post(u, path, payload) for u in self.urls))
        bad = [(u, s, b) for u, (s, b) in zip(self.urls, results, strict=True) if s != 200]
        if bad:
            raise RuntimeError(f"{path} failed: {bad}")
        return [b for _, b in results]

    async def health(self, url: str | None = None, generate: bool = False) -> bool:
        """True when ``/health`` (or ``/health_generate``) answers 200 on ``url`` (default: all servers)."""
        path = "/health_generate" if generate else "/health"
        try:
            codes = await asyncio.gather(*(self._get(u, path) for u in ([url] if url else self.urls)))
        except (aiohttp.ClientError, TimeoutError, ConnectionError):
            return False
        return all(s == 200 for s, _ in codes)

    async def wait_healthy(self, timeout: float = 60.0, interval: float = 0.2) -> None:
        """Poll /health until every server answers 200; raises TimeoutError otherwise."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not await self.health():
            if loop.time() > deadline:
                raise TimeoutError(f"servers not healthy after {timeout}s: {self.urls}")
            await asyncio.sleep(interval)

    async def _info(self, url: str | None, new: str, old: str) -> dict[str, Any]:
        url = url or self.urls[0]
        status, body = await self._get(url, new)
        if status == 404:  # older servers
            status, body = await self._get(url, old)
        if status != 200:
            raise RuntimeError(f"{new} on {url}: HTTP {status} {body}")
        return body

    async def model_info(self, url: str | None = None) -> dict[str, Any]:
        """``GET /model_info`` (falls back to ``/get_model_info``)."""
        return await self._info(url, "/model_info", "/get_model_info")

    async def server_info(self, url: str | None = None) -> dict[str, Any]:
        """``GET /server_info`` (falls back to ``/get_server_info``)."""
        return await self._info(url, "/server_info", "/get_server_info")

    async def abort(self, rid: str = "", abort_all: bool = False) -> None:
        """``POST /abort_request`` on every server (SGLang matches ``rid`` by prefix).

        ``abort(rid=client.rid_prefix)`` aborts every request of this client; aborting everything on the
        servers needs ``abort_all=True`` (an empty ``rid`` alone is refused: as a prefix it matches any rid).
        """
        if not rid and not abort_all:
            raise ValueError("rid: empty; pass a rid (prefix) or abort_all=True")
        await self._post_all("/abort_request", {"rid": rid, "abort_all": abort_all})

    async def pause(self, mode: str = "abort") -> None:
        """``POST /pause_generation`` (mode abort | retract | in_place) on every server.

        Until :meth:`continue_generation`, this client also holds back new /generate requests (resumed or
        retried samples wait in the client), so the servers become idle and ``flush_cache`` can succeed.
        """
        self._running_event().clear()
        await self._post_all("/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        """``POST /continue_generation`` on every server, then release held-back requests."""
        try:
            await self._post_all("/continue_generation", {})
        finally:
            self._running_event().set()

    async def flush_cache(self, max_tries: int = 50, interval: float = 0.1) -> None:
        """``POST /flush_cache`` on every server, retrying the 400 SGLang gives while requests are in flight.

        Any other error status fails at once (flushing is safe to repeat, but only the 400 is transient).
        """
        for u in self.urls:
            for i in range(max_tries):
                status, body = await self._post(u, "/flush_cache")
                if status == 200:
                    break
                if status != 400 or i == max_tries - 1:
                    raise RuntimeError(f"flush_cache on {u}: HTTP {status} {body}")
                await asyncio.sleep(interval)

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, flush_cache: bool = True,
        load_format: str | None = None,
    ) -> None:
        """``POST /update_weights_from_disk`` on every server; raises unless all report success."""
        payload: dict[str, Any] = {"model_path": model_path, "flush_cache": flush_cache}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        if load_format is not None:
            payload["load_format"] = load_format
        for body in await self._post_all("/update_weights_from_disk", payload):
            if not (isinstance(body, dict) and body.get("success")):
                raise RuntimeError(f"update_weights_from_disk failed: {body}")

    async def sync_weights_from_disk(self, model_path: str, weight_version: str, pause_mode: str = "abort") -> None:
        """The usual sequence: pause -> update from disk -> flush_cache (retried) -> continue."""
        await self.pause(pause_mode)
        try:
            await self.update_weights_from_disk(model_path, weight_version, flush_cache=False)
            await self.flush_cache()
        finally:
            await self.continue_generation()

    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int,
        group_name: str = "weight_update_group", backend: str = "nccl",
    ) -> list[Any]:
        """``POST /init_weights_update_group`` (NCCL group between trainer rank 0 and the servers; GPU only)."""
        return await self._post_all("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    async def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]],
        group_name: str = "weight_update_group", flush_cache: bool = False, weight_version: str | None = None,
    ) -> list[Any]:
        """``POST /update_weights_from_distributed``: the servers receive the tensors by NCCL broadcast."""
        payload: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                                   "flush_cache": flush_cache}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return await self._post_all("/update_weights_from_distributed", payload)

    # ---- router ----------------------------------------------------------------------------------------
    async def add_worker(self, worker_url: str) -> Any:
        """Register a worker with an sglang-router at ``self.urls[0]`` (``POST /workers``, older: /add_worker)."""
        status, body = await self._post(self.urls[0], "/workers", {"url": worker_url})
        if status == 404:
            async with self._get_session().post(f"{self.urls[0]}/add_worker", params={"url": worker_url}) as r:
                status, body = r.status, await _body(r)
        if status >= 300:
            raise RuntimeError(f"add_worker {worker_url}: HTTP {status} {body}")
        return body

    async def list_workers(self) -> Any:
        """Workers known to the router (``GET /workers``, older: ``/list_workers``)."""
        status, body = await self._get(self.urls[0], "/workers")
        if status == 404:
            status, body = await self._get(self.urls[0], "/list_workers")
        return body


async def _body(resp: aiohttp.ClientResponse) -> Any:
    raw = await resp.read()
    try:
        return json.loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return raw.decode("utf-8", errors="replace")
