"""The client's control plane: worker discovery behind a router, per-worker fan-out, dead workers, pause and abort.

Targets and workers. The client sends ``/generate`` to its *targets* (SGLang servers, or an sglang-router). It
sends every control call to the *workers*: a plain server is its own worker; a router's workers are discovered
with ``GET /workers`` (sglang-router >= 0.2; older: ``/list_workers``) because a router does not forward abort,
pause / continue or weight updates (404), answers ``/flush_cache`` with ``206 partial_success`` while a worker is
busy, and reports its own ``/server_info``.

Every control call goes to each live worker concurrently and either succeeds on all of them or raises
:class:`ControlError` naming each failed worker and why (a ``206`` is a failure, never a success). A worker that
does not answer and fails a health probe is *dead*: it leaves the client's worker set (and its router's, via
``DELETE /workers/{id}``), is listed in :attr:`ControlPlane.dead`, and later calls go on without it; a call with
no live worker left fails. Calls that change the client's state restore it when they fail: a failed ``pause``
continues the workers and releases the requests the client holds back. A control call that its caller cancels
(a timeout, an early stop, Ctrl-C) ends then, not at its own timeout (``http.cancel_for_certain``).

The client (:class:`~slime_corr.rollout.client.SGLangClient`) holds its :class:`ControlPlane` as ``client.control``
and shares with it a :class:`RequestGate` (its requests in flight, held back by a pause); a ControlPlane also
works alone, given URLs and an HTTP session.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

from slime_corr.rollout.http import cancel_for_certain, read_body

PROBE_TIMEOUT = 3.0  # seconds a health probe or a discovery request may take
class ControlError(RuntimeError):
    """A control call that failed on some workers: ``failures`` maps worker URL -> reason; ``succeeded`` lists
    the workers where it took effect (so a caller can undo it there)."""

    def __init__(self, path: str, failures: dict[str, str], succeeded: Sequence[str] = ()) -> None:
        self.path, self.failures, self.succeeded = path, dict(failures), list(succeeded)
        detail = "; ".join(f"{w}: {r}" for w, r in failures.items())
        super().__init__(f"{path} failed on {len(failures)} of {len(failures) + len(self.succeeded)} worker(s): "
                         f"{detail}")


class EnginesDownError(ControlError):
    """No engine (or router) of the client passes its health check any more: ``failures`` maps each dead one to
    why."""

    def __init__(self, dead: dict[str, str]) -> None:
        super().__init__("health check", dead)
        detail = "; ".join(f"{w}: {r}" for w, r in dead.items())
        self.args = (f"no rollout engine is left: {detail}. Check that each engine (or router) process is alive and "
                     "not stopped (a SIGSTOP, a debugger, swapping) and read its log; --rollout-health-check-interval "
                     "and --rollout-health-check-timeout set how soon this is found.",)


def _is_success(status: int, body: Any, weight_call: bool = False) -> str | None:
    """None when a control answer is a full success, else why not (206 partial_success is a failure). A weight
    call (`weight_call`) succeeds only on SGLang's own answer, a JSON object with ``"success": true``."""
    if status == 206 or (isinstance(body, dict) and body.get("status") == "partial_success"):
        failed = body.get("failed") if isinstance(body, dict) else None
        return f"HTTP {status} partial_success (failed: {failed})"
    if not 200 <= status < 300:
        return f"HTTP {status}: {str(body)[:300]}"
    if isinstance(body, dict) and body.get("success") is False:
        return f"success=false: {body.get('message')}"
    if weight_call and not (isinstance(body, dict) and body.get("success") is True):
        return (f"HTTP {status} without SGLang's answer {{\"success\": true, ...}} (got {str(body)[:120]!r}): the "
                "update is not known to have been applied; is it an SGLang server?")
    return None


SYNC_PAUSE_MODES = ("abort", "retract")


def check_sync_pause_mode(mode: str) -> None:
    """A weight sync pauses with ``abort`` or ``retract``. ``in_place`` is refused: it keeps the running requests'
    KV cache, so SGLang answers every ``/flush_cache`` with 400 until they finish (the sync could never complete),
    and a pause held past the server's watchdog (300 s) makes it shut down."""
    if mode not in SYNC_PAUSE_MODES:
        raise ValueError(f"pause_mode {mode!r}: a weight sync pauses with 'abort' (running requests come back "
                         "aborted and are resumed) or 'retract' (held, finished under the new weights); 'in_place' "
                         "keeps their KV cache, and SGLang refuses to flush it (/flush_cache answers 400).")


class RequestGate:
    """The client's /generate requests as its control plane sees them: the ones in flight (``inflight``: rid -> the
    target it was sent to, for :meth:`ControlPlane.abort`) and whether new ones are held back (from a pause until
    its continue)."""

    def __init__(self) -> None:
        self.inflight: dict[str, str] = {}
        self._open: asyncio.Event | None = None  # cleared between pause() and continue_generation(); made on first use

    def _event(self) -> asyncio.Event:
        if self._open is None:
            self._open = asyncio.Event()
            self._open.set()
        return self._open

    def hold(self) -> None:
        """Hold back new /generate requests (between pause and continue)."""
        self._event().clear()

    def release(self) -> None:
        self._event().set()

    @property
    def held(self) -> bool:
        """New requests are held back (a pause without its continue yet)."""
        return not self._event().is_set()

    async def wait_open(self) -> None:
        """Until new requests may be sent (at once when nothing holds them back)."""
        await self._event().wait()


class ControlPlane:
    """Every call to the engines but ``/generate`` (module doc): sent to ``urls`` (servers or routers) through the
    HTTP session ``session()`` gives, each bounded by ``timeout`` seconds unless a call says otherwise. ``gate``:
    the requests its pause holds back and its abort ends (the client's; a gate of its own by default)."""

    def __init__(self, urls: Sequence[str], session: Callable[[], aiohttp.ClientSession], *,
                 timeout: float = 600.0, gate: RequestGate | None = None) -> None:
        self.urls = list(urls)
        self.timeout = timeout  # seconds one control call (a weight update...) may take
        self.gate = gate if gate is not None else RequestGate()
        self._session = session
        self._workers_of: dict[str, list[str]] | None = None  # target -> its workers (discovered lazily)
        self._router_ids: dict[str, tuple[str, str]] = {}  # worker -> (router url, worker id at the router)
        self.dead: dict[str, str] = {}  # worker or target url -> why it is considered dead
        self.events: list[str] = []  # what the control plane did on its own (dead workers...), for reports
        self._sweeps: dict[str, asyncio.Lock] = {}
        self._discovering = asyncio.Lock()
        self._last_sweep: dict[str, float] = {}

    # ---- HTTP ---------------------------------------------------------------------------------------
    async def _request(self, method: str, url: str, path: str, payload: Any = None, *,
                       timeout: float | None = None, params: dict[str, str] | None = None) -> tuple[int, Any]:
        kw: dict[str, Any] = {"timeout": aiohttp.ClientTimeout(total=timeout or self.timeout)}
        if payload is not None:
            kw["json"] = payload
        if params:
            kw["params"] = params
        try:
            return await cancel_for_certain(self._send(method, f"{url}{path}", kw))
        except aiohttp.ServerDisconnectedError:
            # a kept-alive connection the server closed as the request went out, unread (SGLang's uvicorn closes
            # idle ones after 5 s): sent once more; a server that is gone refuses that one
            return await cancel_for_certain(self._send(method, f"{url}{path}", kw))

    async def _send(self, method: str, url: str, kw: dict[str, Any]) -> tuple[int, Any]:
        async with self._session().request(method, url, **kw) as resp:
            return resp.status, await read_body(resp)

    async def _post(self, server: str, path: str, payload: dict[str, Any] | None = None,
                    timeout: float | None = None) -> tuple[int, Any]:
        return await self._request("POST", server, path, payload if payload is not None else {}, timeout=timeout)

    async def _get(self, server: str, path: str, timeout: float | None = None) -> tuple[int, Any]:
        return await self._request("GET", server, path, timeout=timeout)

    # ---- discovery -----------------------------------------------------------------------------------
    async def discover(self, refresh: bool = False) -> dict[str, list[str]]:
        """Map each target to its workers: a router's from ``/workers`` (or ``/list_workers``), a server itself."""
        if self._workers_of is not None and not refresh:
            return self._workers_of
        async with self._discovering:
            if self._workers_of is not None and not refresh:  # found while we waited
                return self._workers_of
            found = await asyncio.gather(*(self._discover_one(u) for u in self.urls))
            old = self._workers_of or {}
            self._workers_of = {u: old[u] if ws == [u] and u in self.dead and old.get(u, [u]) != [u] else ws
                                for u, ws in zip(self.urls, found, strict=True)}  # a dead router keeps its workers
            for u, workers in self._workers_of.items():
                for w in workers if workers != [u] else []:
                    self.dead.pop(w, None)  # listed again by its router: alive (a router drops dead workers)
            return self._workers_of

    async def _discover_one(self, url: str) -> list[str]:
        try:
            status, body = await self._get(url, "/workers", timeout=PROBE_TIMEOUT)
            if status == 200 and isinstance(body, dict) and isinstance(body.get("workers"), list):
                out = []
                for w in body["workers"]:
                    if isinstance(w, dict) and w.get("url"):
                        out.append(str(w["url"]).rstrip("/"))
                        if w.get("id"):
                            self._router_ids[out[-1]] = (url, str(w["id"]))
                return out
            status, body = await self._get(url, "/list_workers", timeout=PROBE_TIMEOUT)
            if status == 200 and isinstance(body, dict) and isinstance(body.get("urls"), list):
                return [str(u).rstrip("/") for u in body["urls"]]
        except (aiohttp.ClientError, TimeoutError, ConnectionError):
            pass  # unreachable: treated as a plain server, found dead when used
        return [url]

    def is_router(self, url: str) -> bool:
        """``url`` (a target) was discovered to be a router."""
        return self._workers_of is not None and self._workers_of.get(url) != [url]

    async def workers(self, target: str | None = None) -> list[str]:
        """Live workers (of ``target``, or of every target), discovering them on first use."""
        topo = await self.discover()
        if any(not ws for ws in topo.values()):  # a router that had not registered its workers yet
            topo = await self.discover(refresh=True)
        targets = [target] if target is not None else self.urls
        return [w for t in targets for w in topo.get(t, [t]) if w not in self.dead]

    # ---- dead workers --------------------------------------------------------------------------------
    async def _alive(self, url: str) -> bool:
        try:
            status, _ = await self._get(url, "/health", timeout=PROBE_TIMEOUT)
        except (aiohttp.ClientError, TimeoutError, ConnectionError):
            return False
        return status == 200

    async def _mark_dead(self, worker: str, reason: str) -> None:
        if worker in self.dead:
            return
        self.dead[worker] = reason
        if self.is_router(worker):
            self.events.append(f"router {worker} is dead ({reason}); sending to its workers directly")
        else:
            self.events.append(f"worker {worker} is dead ({reason}); continuing without it")
        router = self._router_ids.pop(worker, None)
        if router is not None:  # stop the router routing to it (best effort: the router also health-checks)
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ConnectionError):
                await self._request("DELETE", router[0], f"/workers/{router[1]}", timeout=PROBE_TIMEOUT)

    async def check_target(self, target: str) -> list[str]:
        """After a failed request to ``target``: health-probe its workers, mark the dead ones; returns them.

        One sweep at a time per target, at most one every half second (a burst of failures shares it).
        """
        lock = self._sweeps.setdefault(target, asyncio.Lock())
        async with lock:
            if time.monotonic() - self._last_sweep.get(target, 0.0) < 0.5:
                return []
            if self.is_router(target) and target not in self.dead and not await self._alive(target):
                await self._mark_dead(target, "the router does not answer /health after a failed request")
            workers = await self.workers(target)
            alive = await asyncio.gather(*(self._alive(w) for w in workers))
            dead = [w for w, ok in zip(workers, alive, strict=True) if not ok]
            for w in dead:
                await self._mark_dead(w, "no answer to /health after a failed request")
            self._last_sweep[target] = time.monotonic()
            return dead

    async def _answers_health(self, url: str, timeout: float, generate: bool = True) -> str | None:
        """None when ``url`` answers ``/health_generate`` (``generate``; ``/health`` where it has none: 404) or
        ``/health`` with 200 within ``timeout`` seconds, else why not."""
        try:
            status = 404
            if generate:
                status, _ = await self._get(url, "/health_generate", timeout=timeout)
            if status == 404:
                status, _ = await self._get(url, "/health", timeout=timeout)
        except (aiohttp.ClientError, ConnectionError) as e:
            return f"health check failed: {e!r}"
        except TimeoutError:
            return f"no answer to its health check within {timeout:g} s"
        return None if status == 200 else f"health check answered HTTP {status}"

    async def watch_health(self, interval: float, timeout: float, generate: bool = True) -> None:
        """Until cancelled: every ``interval`` seconds, health-check every live worker and every router target
        concurrently (``timeout`` each; ``generate=False``: ``/health`` only, as while the engines are paused for a
        weight update, when ``/health_generate`` cannot answer); the ones that fail are marked dead (their requests go to the others).
        Raises :class:`EnginesDownError` naming them when no live target or worker is left: the rollout cannot go on.
        """
        while True:
            await asyncio.sleep(interval)
            topo = await self.discover()
            probed = [t for t in self.live_targets() if topo.get(t) != [t]] + await self.workers()
            reasons = await asyncio.gather(*(self._answers_health(u, timeout, generate) for u in probed))
            for url, reason in zip(probed, reasons, strict=True):
                if reason is not None:
                    await self._mark_dead(url, reason)
            if not await self.workers():  # (a dead router's live workers still serve)
                raise EnginesDownError(dict(self.dead))

    def live_targets(self) -> list[str]:
        """Targets not known dead (a router is dead only when it does not answer itself)."""
        return [u for u in self.urls if u not in self.dead]

    def orphaned_workers(self) -> list[str]:
        """Live workers behind dead routers: the client sends them /generate directly."""
        topo = self._workers_of or {}
        return [w for t in self.urls if t in self.dead for w in topo.get(t, []) if w != t and w not in self.dead]

    # ---- fan-out -------------------------------------------------------------------------------------
    async def fan_out(self, path: str, payload: dict[str, Any] | Callable[[str], dict[str, Any]] | None = None,
                      *, workers: Sequence[str] | None = None, timeout: float | None = None,
                      allow_404: bool = False, weight_call: bool = False) -> dict[str, Any]:
        """POST ``path`` to each live worker (``payload`` may depend on the worker); {worker: body} or raise.

        A worker that cannot be reached and fails a health probe is marked dead and left out. ``allow_404``:
        a 404 (an older server without the endpoint) counts as success with body ``None``. ``weight_call``: only
        SGLang's ``{"success": true}`` counts as success (see `_is_success`).
        """
        targets = list(workers) if workers is not None else await self.workers()
        if not targets:
            raise ControlError(path, {"(none)": f"no live worker (dead: {self.dead})"})

        async def one(w: str) -> tuple[str, str | None, Any]:
            body = payload(w) if callable(payload) else payload
            try:
                status, answer = await self._post(w, path, body, timeout=timeout)
            except (aiohttp.ClientError, TimeoutError, ConnectionError) as e:
                if not await self._alive(w):
                    await self._mark_dead(w, f"{path}: {type(e).__name__}: {e}")
                    return w, "dead", None
                if isinstance(e, TimeoutError):  # alive (its health check answers), yet this call went unanswered
                    return w, (f"no answer within {timeout or self.timeout:.0f} s though its health check "
                               "answers (the bound: the client's control_timeout, the trainer's "
                               "--rollout-control-timeout): is the server stuck? Its log says why"), None
                return w, f"request failed: {e!r}", None
            if allow_404 and status == 404:
                return w, None, None
            return w, _is_success(status, answer, weight_call), answer

        results = await asyncio.gather(*(one(w) for w in targets))
        failures = {w: why for w, why, _ in results if why not in (None, "dead")}
        ok = {w: body for w, why, body in results if why is None}
        if not failures and not ok:
            raise EnginesDownError(dict(self.dead))
        if failures or not ok:
            raise ControlError(path, failures or {"(all)": f"every worker is dead: {self.dead}"}, list(ok))
        return ok

    # ---- info and health -----------------------------------------------------------------------------
    async def health(self, url: str | None = None, generate: bool = False) -> bool:
        """True when ``/health`` (or ``/health_generate``) answers 200 on ``url`` (default: every target)."""
        path = "/health_generate" if generate else "/health"
        try:
            codes = await asyncio.gather(*(self._get(u, path, timeout=PROBE_TIMEOUT)
                                           for u in ([url] if url else self.urls)))
        except (aiohttp.ClientError, TimeoutError, ConnectionError):
            return False
        return all(s == 200 for s, _ in codes)

    async def wait_healthy(self, timeout: float = 60.0, interval: float = 0.2, min_workers: int = 0) -> None:
        """Poll until every target answers ``/health`` and at least ``min_workers`` workers are known
        (a router registers its workers in the background); raises TimeoutError otherwise."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if await self.health():
                topo = await self.discover(refresh=True)
                if sum(len(ws) for ws in topo.values()) >= min_workers:
                    return
            if loop.time() > deadline:
                raise TimeoutError(f"servers not healthy (or fewer than {min_workers} workers) after {timeout}s: "
                                   f"{self.urls}")
            await asyncio.sleep(interval)

    async def _info(self, url: str | None, new: str, old: str) -> dict[str, Any]:
        if url is None:
            live = await self.workers()
            if not live:
                raise ControlError(new, {"(none)": f"no live worker (dead: {self.dead})"})
            url = live[0]
        try:
            status, body = await self._get(url, new)
            if status == 404:  # older servers
                status, body = await self._get(url, old)
        except (aiohttp.ClientError, ConnectionError) as e:  # e.g. a server killed since the call before
            raise ControlError(new, {url: f"request failed: {e!r}"}) from e
        except TimeoutError as e:
            raise ControlError(new, {url: f"no answer within {self.timeout:g} s (the client's "
                                          "control_timeout, the trainer's --rollout-control-timeout)"}) from e
        if status != 200:
            raise ControlError(new, {url: f"HTTP {status} {body}"})
        return body

    async def model_info(self, url: str | None = None) -> dict[str, Any]:
        """``GET /model_info`` of ``url`` (default: the first live worker; falls back to ``/get_model_info``)."""
        return await self._info(url, "/model_info", "/get_model_info")

    async def server_info(self, url: str | None = None) -> dict[str, Any]:
        """``GET /server_info`` of ``url`` (default: the first live worker - not a router's own info)."""
        return await self._info(url, "/server_info", "/get_server_info")

    async def weight_versions(self, workers: Sequence[str] | None = None) -> dict[str, str | None]:
        """The weight version each of `workers` (default: every live worker) reports (``/model_info``)."""
        workers = list(workers) if workers is not None else await self.workers()
        infos = await asyncio.gather(*(self.model_info(w) for w in workers))
        return {w: i.get("weight_version") if isinstance(i, dict) else None
                for w, i in zip(workers, infos, strict=True)}

    # ---- request control -----------------------------------------------------------------------------
    async def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        """``POST /abort_request`` on every live worker.

        ``abort_all=True`` aborts everything on the workers; ``rid`` one request (an exact rid: SGLang 0.5.23
        ignores a rid it does not know, so a prefix alone aborts nothing); neither aborts every request in flight
        through the gate (the client's), each on the workers behind the target it was sent to.
        """
        if abort_all or rid:
            await self.fan_out("/abort_request", {"rid": rid or "", "abort_all": bool(abort_all)})
            return
        if rid == "":
            raise ValueError("rid: empty; pass a rid, abort_all=True, or nothing (this client's requests)")
        await asyncio.gather(*(self.abort_rid(t, r) for r, t in list(self.gate.inflight.items())))

    async def abort_rid(self, target: str, rid: str) -> None:
        """Abort ``rid`` on every live worker behind ``target`` (best effort, bounded: never raises)."""
        with contextlib.suppress(Exception):
            await self.fan_out("/abort_request", {"rid": rid}, workers=await self.workers(target),
                               timeout=PROBE_TIMEOUT)

    async def pause(self, mode: str = "abort") -> None:
        """``POST /pause_generation`` (mode abort | retract | in_place) on every live worker.

        Until :meth:`continue_generation`, the gate also holds back the client's new /generate requests (resumed
        or retried samples wait in the client), so the workers become idle and ``flush_cache`` can succeed.
        On failure, every worker is continued (continuing is harmless where the pause did not land) and the
        gate releases the requests.
        """
        self.gate.hold()
        try:
            await self.fan_out("/pause_generation", {"mode": mode})
        except BaseException:
            with contextlib.suppress(Exception):  # also where it failed: it may have half happened there
                await self.fan_out("/continue_generation", {})
            self.gate.release()
            raise

    async def continue_generation(self) -> None:
        """``POST /continue_generation`` on every live worker, then release held-back requests (always)."""
        try:
            await self.fan_out("/continue_generation", {})
        finally:
            self.gate.release()

    async def flush_cache(self, max_tries: int = 50, interval: float = 0.1) -> None:
        """``POST /flush_cache`` on every live worker, retrying the 400 SGLang gives while requests are in flight.

        Any other error status fails at once (flushing is safe to repeat, but only the 400 is transient).
        """
        async def one(w: str) -> None:
            for i in range(max_tries):
                try:
                    await self.fan_out("/flush_cache", workers=[w])
                    return
                except ControlError as e:
                    if not e.failures.get(w, "").startswith("HTTP 400") or i == max_tries - 1:
                        raise
                await asyncio.sleep(interval)

        results = await asyncio.gather(*(one(w) for w in await self.workers()), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            failures = {w: why for e in errors if isinstance(e, ControlError) for w, why in e.failures.items()}
            raise ControlError("/flush_cache", failures or {"?": repr(errors[0])}) from errors[0]

    async def while_paused(self, body: Callable[[], Any], pause_mode: str = "abort") -> Any:
        """Pause, run ``await body()``, continue - also when it fails (its error is the one raised)."""
        await self.pause(pause_mode)
        try:
            result = await body()
        except BaseException:
            with contextlib.suppress(Exception):
                await self.continue_generation()
            raise
        await self.continue_generation()
        return result

    # ---- router --------------------------------------------------------------------------------------
    async def add_worker(self, worker_url: str) -> Any:
        """Register a worker with the router at ``self.urls[0]`` (``POST /workers``, older: /add_worker)."""
        status, body = await self._post(self.urls[0], "/workers", {"url": worker_url})
        if status == 404:
            status, body = await self._request("POST", self.urls[0], "/add_worker", params={"url": worker_url})
        if status >= 300:
            raise ControlError("/workers", {self.urls[0]: f"add {worker_url}: HTTP {status} {body}"})
        self._workers_of = None  # rediscover
        return body

    async def list_workers(self) -> Any:
        """Workers known to the router at ``self.urls[0]`` (``GET /workers``, older: ``/list_workers``)."""
        status, body = await self._get(self.urls[0], "/workers")
        if status == 404:
            status, body = await self._get(self.urls[0], "/list_workers")
        return body
