"""Async client for SGLang servers (or an sglang-router): /generate with log-probs; it holds its control plane
(``client.control``, :mod:`.control`) and its weight calls (``client.weights``, :mod:`.weight_calls`).

Faults and retries (one request per sample, every call ends exactly once: a result or a GenerationError):

======================================  =========================================================
what happened                           what the client does
======================================  =========================================================
connection refused / reset, broken      retry with backoff + jitter and a NEW rid (SGLang rejects a
stream, stream ended without [DONE]     reused in-flight rid; a dropped connection aborts the old one)
timeout; HTTP 400 "Duplicate request ID" /abort_request of the old rid on every worker behind the target
(a router retried it)                   (awaited, bounded), then retry: it must never run twice
HTTP 429, 408, 5xx; abort with a 5xx    retry
HTTP 400 / other 4xx                    fail at once (the request is wrong; retrying cannot help)
error event in a stream                 retry if the event says ``retryable`` (or code 5xx/429), else fail
malformed JSON, missing / misaligned /  retry: the response is unusable, nothing reached a sample, and a
NaN log-probs, inconsistent stream      fresh sample from the same policy is still on-policy; NaN never
                                        reaches a sample
abort without status (abort / pause)    returned as a result with ``finish_type == "abort"`` and the partial
                                        output; the driver (:mod:`.rollout`) applies the pause policy
the caller is cancelled (an early       the attempt is cancelled again until it has ended
stop, Ctrl-C)                           (``cancel_for_certain``: aiohttp can lose a cancel)
======================================  =========================================================

After ``RetryPolicy.max_attempts`` attempts the call raises :class:`GenerationError` with the last reason.
A connection failure, or a 5xx through a router, also health-probes the workers behind that target: dead ones
leave the client (and the router), so the retries go to live engines - a killed engine loses no sample.
A request issued while the client is paused waits for ``continue_generation`` at most ``max_pause_wait``
seconds, then fails: never a silent hang.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from slime_corr.rollout.control import ControlPlane, RequestGate
from slime_corr.rollout.http import cancel_for_certain
from slime_corr.rollout.nucleus import NucleusRequest
from slime_corr.rollout.protocol import (
    GenerateOutput,
    NonFiniteLogProbError,
    ResponseError,
    StreamAccumulator,
    StreamErrorEvent,
    build_generate_request,
    parse_generate_response,
)
from slime_corr.rollout.weight_calls import WeightCalls
from slime_corr.routed_experts import RoutedExpertsSpec

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# Seconds an idle pooled connection is kept: below the 5 s after which SGLang's server (uvicorn,
# SGLANG_TIMEOUT_KEEP_ALIVE) closes it, so a request does not go out on a connection the server is closing
# (aiohttp's default keeps them 15 s: ServerDisconnectedError, seen on control requests between weight syncs)
KEEPALIVE_TIMEOUT = 4.0


class GenerationError(Exception):
    """A /generate call that ended without a usable result; ``reason`` says why, ``attempts`` how many tries.

    ``maybe_running``: the server may still be generating the request (a timeout): abort its rid before retrying.
    ``target_down``: the target or an engine behind it may be dead: probe them before retrying.
    """

    def __init__(self, reason: str, retryable: bool = False, attempts: int = 0, maybe_running: bool = False,
                 target_down: bool = False, server: str = "", kind: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.retryable = retryable
        self.attempts = attempts
        self.maybe_running = maybe_running
        self.target_down = target_down
        self.server = server  # the target of the last attempt
        self.kind = kind or failure_kind(reason)  # what went wrong, in a word or two (see `failure_kind`)


# reason prefix -> kind (the reasons `SGLangClient._attempt` gives)
_KINDS = (("HTTP 4", "HTTP 4xx"), ("HTTP 5", "HTTP 5xx"), ("timeout", "timeout"),
          ("connection failed", "connection refused"), ("connection broken", "connection broken"),
          ("bad response", "bad response"), ("non-finite log-prob", "non-finite log-prob"),
          ("stream error event", "stream error event"),
          ("aborted by server", "aborted by server"), ("the client stayed paused", "paused"))


def failure_kind(reason: str) -> str:
    """The kind of a failure reason: "timeout", "connection refused", "bad response", "HTTP 5xx", ... ("other")."""
    for prefix, kind in _KINDS:
        if reason.startswith(prefix):
            return kind
    return "other"


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
    """Talks to one or more SGLang servers (or sglang-routers) with bounded concurrency per target.

    Use as ``async with SGLangClient(urls) as client: ...``. Request ids are fixed-width and unique
    (``{prefix}-{counter:012d}`` with a random 8-character per-client prefix) because SGLang's scheduler aborts
    every rid a given rid prefixes: no rid of this client is a prefix of another. ``abort()`` aborts exactly the
    requests this client has in flight.

    The client generates; it holds ``control`` (:class:`~slime_corr.rollout.control.ControlPlane`: workers, health,
    dead engines, pause / continue, abort, flush, info) and ``weights``
    (:class:`~slime_corr.rollout.weight_calls.WeightCalls`: weight updates, over ``control``), both sending through
    its HTTP session, and ``gate`` (:class:`~slime_corr.rollout.control.RequestGate`: its requests in flight, held
    back by a pause), shared with ``control``. The calls a rollout makes between generations stay on the client
    too: ``pause``, ``continue_generation``, ``abort``, ``flush_cache``, ``sync_weights_from_disk``,
    ``update_weights_from_disk``, ``weight_versions``.
    """

    def __init__(
        self,
        urls: str | list[str],
        max_concurrency_per_server: int = 64,
        request_timeout: float | None = 600.0,
        connect_timeout: float = 10.0,
        read_timeout: float | None = 120.0,
        retry: RetryPolicy | None = None,
        rid_prefix: str | None = None,
        control_timeout: float = 600.0,
        max_pause_wait: float = 3600.0,
    ) -> None:
        self.urls = [u.rstrip("/") for u in ([urls] if isinstance(urls, str) else urls)]
        if not self.urls:
            raise ValueError("urls: at least one server URL is required")
        self.max_concurrency = max_concurrency_per_server
        self.timeout = aiohttp.ClientTimeout(total=request_timeout, sock_connect=connect_timeout,
                                             sock_read=read_timeout)
        self.retry = retry or RetryPolicy()
        self.max_pause_wait = max_pause_wait  # seconds a request waits for continue_generation before failing
        self.rid_prefix = rid_prefix or secrets.token_hex(4)
        if len(self.rid_prefix) != 8 or not self.rid_prefix.isalnum() or not self.rid_prefix.isascii():
            raise ValueError(f"rid_prefix: must be 8 ASCII letters/digits (fixed width, as SGLang's abort matches "
                             f"rids by prefix), got {self.rid_prefix!r}")
        self._counter = itertools.count()
        self._sems = {u: asyncio.Semaphore(max_concurrency_per_server) for u in self.urls}
        self._load: dict[str, int] = dict.fromkeys(self.urls, 0)  # requests assigned (queued or in flight)
        self._rr = itertools.count()
        self._session: aiohttp.ClientSession | None = None
        self._closed = False  # close() was called: no new session until the client is entered again
        self.failovers = 0  # attempts retried after a connection failure or a dead engine
        self.gate = RequestGate()  # rid -> target of requests sent and not answered yet; held back by a pause
        # control_timeout: seconds one control call (a weight update...) may take
        self.control = ControlPlane(self.urls, self._get_session, timeout=control_timeout, gate=self.gate)
        self.weights = WeightCalls(self.control)

    # ---- session ---------------------------------------------------------------------------------------
    async def __aenter__(self) -> SGLangClient:
        self._closed = False
        self._get_session()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _get_session(self) -> aiohttp.ClientSession:
        if self._closed:  # a task still running at shutdown must not open a session nobody closes
            raise GenerationError("the client is closed (the run is ending): nothing more is sent", False)
        if self._session is None or self._session.closed:
            n = self.max_concurrency
            connector = aiohttp.TCPConnector(limit=n * len(self.urls) + 8, limit_per_host=n + 4,
                                             keepalive_timeout=KEEPALIVE_TIMEOUT)
            self._session = aiohttp.ClientSession(timeout=self.timeout, connector=connector)
        return self._session

    async def close(self) -> None:
        """Close the HTTP session; until the client is entered again (`async with`), nothing more is sent."""
        self._closed = True
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def paused(self) -> bool:
        """The client holds back new requests (a pause without its continue yet)."""
        return self.gate.held

    async def _wait_running(self) -> None:
        try:
            await asyncio.wait_for(self.gate.wait_open(), self.max_pause_wait)
        except TimeoutError as e:
            raise GenerationError(f"the client stayed paused for more than max_pause_wait={self.max_pause_wait}s: "
                                  "continue_generation() was never called") from e

    def new_rid(self) -> str:
        """A fresh fixed-width request id (never a prefix of another one from this client)."""
        return f"{self.rid_prefix}-{next(self._counter):012d}"

    def _pick_server(self, avoid: str | None = None) -> str:
        """Least loaded live target (round-robin among ties), avoiding ``avoid`` when there is a choice. A dead
        router's live workers take its place (they serve /generate themselves)."""
        live = self.control.live_targets() + self.control.orphaned_workers()
        for u in live:
            self._sems.setdefault(u, asyncio.Semaphore(self.max_concurrency))
            self._load.setdefault(u, 0)
        live = live or self.urls
        cands = [u for u in live if u != avoid] or live
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
        routed_experts: RoutedExpertsSpec | None = None,
        nucleus: NucleusRequest | None = None,
        sampling_mask: bool = False,
    ) -> GenerateResult:
        """Generate one sample from token ids; retries safe faults; raises :class:`GenerationError`.
        ``routed_experts``: ask for the MoE routes and check them against this shape (``result.routed_experts``).
        ``nucleus``: ask for the engine's top-N log-probs and read its nucleus (``result.nucleus_log_mass``).
        ``sampling_mask``: ask for every token's kept set and its support log-probs (``result.kept_ids``,
        ``kept_log_probs``; ``nucleus_log_mass`` from them); the sampling params need a finite top_k
        (`protocol.sampling_mask_params`)."""
        routes = routed_experts is not None
        top_n = nucleus.num if nucleus is not None else 0
        build_generate_request(input_ids, sampling_params, "check", stream, return_logprob, routes, top_n,  # fail fast
                               sampling_mask)
        await self.control.discover()  # once: which targets are routers (their failures are probed worker by worker)
        errors: list[str] = []
        server: str | None = None
        last: GenerationError | None = None
        for attempt in range(1, self.retry.max_attempts + 1):
            server = self._pick_server(avoid=server)
            rid = self.new_rid()
            body = build_generate_request(input_ids, sampling_params, rid, stream, return_logprob, routes, top_n,
                                          sampling_mask)
            self._load[server] += 1  # counted while queued on the semaphore too, so new work goes elsewhere
            try:
                async with self._sems[server]:
                    await self._wait_running()  # nothing is sent between our pause() and continue
                    self.gate.inflight[rid] = server
                    try:
                        out = await cancel_for_certain(
                            self._attempt(server, body, stream, return_logprob, routed_experts, nucleus, sampling_mask))
                    finally:
                        self.gate.inflight.pop(rid, None)
                return GenerateResult(**vars(out), server=server, attempts=attempt, errors=errors)
            except GenerationError as e:
                errors.append(f"attempt {attempt} ({rid} @ {server}): {e.reason}")
                last = e
                if not e.retryable:
                    raise GenerationError(e.reason, False, attempt, server=server) from e
                if e.maybe_running:  # must not run twice: abort it on the workers before the retry is sent
                    await self.control.abort_rid(server, rid)
                if e.target_down:  # dead engines leave the client (and the router) before the retry
                    await self.control.check_target(server)
                    self.failovers += 1
            finally:
                self._load[server] -= 1
            if attempt < self.retry.max_attempts:
                await asyncio.sleep(self.retry.delay(attempt))  # backoff with jitter; the next try gets a new rid
        raise GenerationError(f"gave up after {self.retry.max_attempts} attempts; " + "; ".join(errors),
                              False, self.retry.max_attempts, server=server or "",
                              kind=last.kind if last is not None else "")

    async def _attempt(self, server: str, body: dict[str, Any], stream: bool, want_lp: bool,
                       routes: RoutedExpertsSpec | None = None, nucleus: NucleusRequest | None = None,
                       sampling_mask: bool = False) -> GenerateOutput:
        """One HTTP attempt, with every failure mapped to a GenerationError(retryable=...)."""
        session = self._get_session()
        try:
            async with session.post(f"{server}/generate", json=body) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:300]
                    if resp.status == 400 and "Duplicate request ID" in text:  # a router re-sent our rid
                        raise GenerationError(f"HTTP 400: {text}", True, maybe_running=True)
                    raise GenerationError(f"HTTP {resp.status}: {text}", resp.status in RETRYABLE_STATUS,
                                          target_down=resp.status >= 500 and self.control.is_router(server))
                if stream:
                    out = await self._read_stream(resp, want_lp, routes, nucleus, sampling_mask)
                else:
                    try:
                        obj = json.loads(await resp.read())
                    except (json.JSONDecodeError, UnicodeDecodeError) as e:
                        raise ResponseError(f"response: malformed JSON ({e})") from e
                    out = parse_generate_response(obj, want_lp, routes, nucleus, sampling_mask)
        except GenerationError:
            raise
        except NonFiniteLogProbError as e:  # another engine may serve it (retried elsewhere when there is one)
            raise GenerationError(f"non-finite log-prob: {e}", retryable=True) from e
        except ResponseError as e:
            raise GenerationError(f"bad response: {e}", retryable=True) from e
        except StreamErrorEvent as e:
            raise GenerationError(str(e), retryable=e.retryable) from e
        except TimeoutError as e:
            raise GenerationError(f"timeout ({e!r})", retryable=True, maybe_running=True) from e
        except aiohttp.ClientConnectorError as e:
            raise GenerationError(f"connection failed: {e}", retryable=True, target_down=True) from e
        except (aiohttp.ClientError, ConnectionError) as e:  # disconnects, payload errors, resets
            raise GenerationError(f"connection broken: {e!r}", retryable=True, target_down=True) from e
        fr = out.finish_reason or {}
        if fr.get("type") == "abort" and fr.get("status_code"):
            code = int(fr["status_code"])
            raise GenerationError(f"aborted by server with status {code}: {fr.get('message')}",
                                  code in RETRYABLE_STATUS)
        return out

    async def _read_stream(self, resp: aiohttp.ClientResponse, want_lp: bool,
                           routes: RoutedExpertsSpec | None = None, nucleus: NucleusRequest | None = None,
                           sampling_mask: bool = False) -> GenerateOutput:
        acc = StreamAccumulator(want_lp, routes, nucleus, sampling_mask)
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


    # ---- the rollout's control calls (`control`'s and `weights`', kept on the client) --------------------
    async def pause(self, mode: str = "abort") -> None:
        """Pause every live worker and hold back new requests: :meth:`ControlPlane.pause`."""
        await self.control.pause(mode)

    async def continue_generation(self) -> None:
        """Continue every live worker and release held-back requests: :meth:`ControlPlane.continue_generation`."""
        await self.control.continue_generation()

    async def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        """Abort ``rid``, everything (``abort_all``) or this client's requests in flight: `ControlPlane.abort`."""
        await self.control.abort(rid, abort_all)

    async def flush_cache(self, max_tries: int = 50, interval: float = 0.1) -> None:
        """Flush every live worker's cache: :meth:`ControlPlane.flush_cache`."""
        await self.control.flush_cache(max_tries, interval)

    async def weight_versions(self, workers: Sequence[str] | None = None) -> dict[str, str | None]:
        """The weight version each worker reports: :meth:`ControlPlane.weight_versions`."""
        return await self.control.weight_versions(workers)

    async def sync_weights_from_disk(self, model_path: str, weight_version: str, pause_mode: str = "abort") -> None:
        """Pause, update from disk, flush, continue: :meth:`WeightCalls.sync_weights_from_disk`."""
        await self.weights.sync_weights_from_disk(model_path, weight_version, pause_mode)

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                       flush_cache: bool = True, load_format: str | None = None) -> None:
        """New weights from a checkpoint folder on every live worker: :meth:`WeightCalls.update_weights_from_disk`."""
        await self.weights.update_weights_from_disk(model_path, weight_version, flush_cache, load_format)


def probe_health(url: str, timeout: float = 5.0) -> str | None:
    """Why ``url`` cannot serve (a one-line reason), or None when its ``/health`` answers 200. Synchronous and
    bounded by ``timeout``: a start-up check before anything else is built."""
    import urllib.error
    import urllib.request

    target = url.rstrip("/") + "/health"
    if not target.startswith(("http://", "https://")):
        return f"not an http(s) URL ({url!r}); e.g. http://127.0.0.1:30000"
    try:
        with urllib.request.urlopen(target, timeout=timeout) as resp:  # noqa: S310 - an http(s) URL, checked above
            return None if resp.status == 200 else f"GET {target} answered HTTP {resp.status}"
    except urllib.error.HTTPError as e:
        return f"GET {target} answered HTTP {e.code}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        return f"GET {target} failed: {reason}"
