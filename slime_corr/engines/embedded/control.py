"""The embedded engine's control plane: SGLang 0.5.23's endpoints and bodies besides ``/generate``.

Health and discovery (``/health``, ``/health_generate``, ``/ready``, ``/model_info``, ``/server_info``,
``/v1/models``, ``/v1/loads``, ``/get_load`` - what sglang-router polls -, ``/metrics``), request control
(``/abort_request``, ``/pause_generation``, ``/continue_generation``, ``/flush_cache``), weights
(``/update_weights_from_disk``, ``/init_weights_update_group``, ``/destroy_weights_update_group``,
``/begin_weight_update``, ``/update_weights_from_distributed``, ``/end_weight_update``,
``/update_weight_version``) and memory (``/release_memory_occupation``, ``/resume_memory_occupation``).

Bodies follow SGLang's ``http_server.py``: abort answers an empty 200; pause / continue ``{"message", "status"}``;
flush plain text (400 while requests run; ``?timeout=`` waits for idle); weight calls ``{"success", "message"}``
with 400 on failure; errors elsewhere ``{"error": {"message"}}``. As in SGLang 0.5.23, an abort names an exact
rid the server knows (then every rid it prefixes goes), and ``/update_weights_from_distributed`` runs only
between ``/begin_weight_update`` and ``/end_weight_update``.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Any, Protocol

from aiohttp import web

from slime_corr.engines.embedded.model import EngineModel
from slime_corr.engines.embedded.requests import (
    BadRequest,
    EngineRequest,
    EngineStats,
    error_response,
    json_body,
)
from slime_corr.rollout.weight_group import FLATTENED_BUCKET, WeightUpdateGroup, dtype_from_name

VERSION = "0.5.23-slime-corr-local"
HOLD_PAUSE, HOLD_MEMORY = "pause", "memory"  # why new requests are held (not admitted)
MEMORY_TAGS = ("weights", "kv_cache")
_FLUSH_OK = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
             "requests, the operation will not be performed.)\n")


class ControlledEngine(Protocol):
    """What :class:`EngineControl` reads and changes on its engine (``LocalEngine`` has it all)."""

    model: EngineModel
    model_path: str
    served_model_name: str
    weight_version: str
    host: str
    port: int
    incremental: bool  # incremental streaming output
    max_running: int
    return_routes: bool
    group_timeout: float  # seconds a weight-update group waits for its peers
    serving: bool
    active: dict[str, EngineRequest]
    holds: set[str]  # reasons new requests are held: HOLD_PAUSE, HOLD_MEMORY
    released: set[str]  # released memory tags
    stats: EngineStats

    @property
    def step_lock(self) -> asyncio.Lock: ...

    def busy(self) -> bool: ...

    def abort(self, rid: str, abort_all: bool, message: str, admitted_only: bool = False) -> None: ...

    def release_hold(self, reason: str) -> None: ...


def weight_response(success: bool, message: str, **extra: Any) -> web.Response:
    """The weight endpoints' ``{"success", "message"}`` body: 400 on failure."""
    return web.json_response({"success": success, "message": message, **extra}, status=200 if success else 400)


def add_control_routes(engine: ControlledEngine, router: web.UrlDispatcher) -> EngineControl:
    """Register every control endpoint of ``engine`` on ``router``; returns their handlers."""
    r, c = router, EngineControl(engine)
    for path in ("/health", "/health_generate"):
        r.add_get(path, c.health)
    r.add_get("/ready", c.ready)
    for path in ("/model_info", "/get_model_info"):
        r.add_get(path, c.model_info)
    for path in ("/server_info", "/get_server_info"):
        r.add_get(path, c.server_info)
    r.add_get("/v1/models", c.models)
    r.add_get("/v1/loads", c.loads)
    r.add_get("/get_load", c.get_load)
    r.add_get("/metrics", c.metrics)
    r.add_post("/abort_request", c.abort)
    r.add_post("/pause_generation", c.pause)
    r.add_post("/continue_generation", c.continue_generation)
    for method in ("GET", "POST"):
        r.add_route(method, "/flush_cache", c.flush_cache)
        r.add_route(method, "/release_memory_occupation", c.release_memory)
        r.add_route(method, "/resume_memory_occupation", c.resume_memory)
    r.add_post("/update_weights_from_disk", c.update_from_disk)
    r.add_post("/update_weight_version", c.update_weight_version)
    r.add_post("/init_weights_update_group", c.init_group)
    r.add_post("/destroy_weights_update_group", c.destroy_group)
    r.add_post("/begin_weight_update", c.begin_update)
    r.add_post("/end_weight_update", c.end_update)
    r.add_post("/update_weights_from_distributed", c.update_from_distributed)
    r.add_post("/update_weights_from_tensor", c.update_from_tensor)
    return c


class EngineControl:
    """Handlers of the control endpoints; state lives on the engine."""

    def __init__(self, engine: ControlledEngine) -> None:
        self.e = engine
        self.groups: dict[str, WeightUpdateGroup] = {}
        self.session_open = False  # between /begin_weight_update and /end_weight_update
        self.started = time.time()

    # ---- health and discovery ---------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.e.serving else 503)

    async def ready(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.e.serving else 503)

    async def model_info(self, request: web.Request) -> web.Response:
        e = self.e
        return web.json_response({
            "model_path": e.model_path, "served_model_name": e.served_model_name, "tokenizer_path": e.model_path,
            "is_generation": True, "preferred_sampling_params": None, "weight_version": e.weight_version,
            "load_format": "torch", "disaggregation_mode": "null", "model_type": None, "architectures": None})

    async def server_info(self, request: web.Request) -> web.Response:
        e = self.e
        return web.json_response({
            "model_path": e.model_path, "served_model_name": e.served_model_name, "tokenizer_path": e.model_path,
            "max_context_length": int(e.model.max_seq_len), "version": VERSION, "host": e.host, "port": e.port,
            "incremental_streaming_output": e.incremental, "disaggregation_mode": "null",
            "max_running_requests": e.max_running, "weight_version": e.weight_version,
            "enable_return_routed_experts": e.return_routes, "startup_time": self.started, "frontend": "python",
            "internal_states": [{"paused": HOLD_PAUSE in e.holds, "num_running": len(e.active),
                                 "memory_released": sorted(e.released)}],
        })

    async def models(self, request: web.Request) -> web.Response:
        e = self.e
        card = {"id": e.served_model_name, "object": "model", "created": int(self.started), "owned_by": "sglang",
                "root": e.served_model_name, "parent": None, "max_model_len": int(e.model.max_seq_len)}
        return web.json_response({"object": "list", "data": [card]})

    def load(self) -> dict[str, Any]:
        """This engine's load snapshot (one DP rank), with SGLang's LoadSnapshot core keys."""
        e = self.e
        running = [r for r in e.active.values() if r.finish is None and r.admitted]
        used = sum(len(r.prompt) + len(r.output_ids) for r in running)
        capacity = int(e.max_running * e.model.max_seq_len)
        return {"timestamp": time.time(), "dp_rank": 0, "num_running_reqs": len(running),
                "num_waiting_reqs": sum(1 for r in e.active.values() if r.finish is None and not r.admitted),
                "num_waiting_uncached_tokens": 0, "num_used_tokens": used, "num_total_tokens": used,
                "num_active_tokens": used, "num_prealloc_ready_tokens": 0, "max_total_num_tokens": capacity,
                "max_running_requests": e.max_running, "token_usage": used / max(1, capacity),
                "gen_throughput": e.stats.throughput(), "cache_hit_rate": 0.0,
                "utilization": len(running) / max(1, e.max_running),
                "total_prefill_uncached_tokens": e.stats.prompt_tokens, "total_prefill_busy_us": 0}

    async def loads(self, request: web.Request) -> web.Response:
        return web.json_response({"timestamp": datetime.now(UTC).isoformat(), "version": VERSION,
                                  "accelerator": None, "num_accelerators": 0, "loads": [self.load()]})

    async def get_load(self, request: web.Request) -> web.Response:
        """The older per-DP-rank list that sglang-router polls for its load view (tokens in use as the load)."""
        ld = self.load()
        return web.json_response([{"dp_rank": 0, "num_reqs": ld["num_running_reqs"] + ld["num_waiting_reqs"],
                                   "num_waiting_reqs": ld["num_waiting_reqs"], "num_tokens": ld["num_used_tokens"]}])

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text exposition with SGLang's metric names."""
        e, ld = self.e, self.load()
        label = f'{{model_name="{e.served_model_name}"}}'
        rows = [("num_running_reqs", "gauge", ld["num_running_reqs"]), ("num_queue_reqs", "gauge",
                ld["num_waiting_reqs"]), ("num_used_tokens", "gauge", ld["num_used_tokens"]),
                ("token_usage", "gauge", ld["token_usage"]), ("gen_throughput", "gauge", ld["gen_throughput"]),
                ("num_requests_total", "counter", e.stats.requests),
                ("num_aborted_requests_total", "counter", e.stats.aborted),
                ("prompt_tokens_total", "counter", e.stats.prompt_tokens),
                ("generation_tokens_total", "counter", e.stats.generation_tokens)]
        lines = []
        for name, kind, value in rows:
            lines += [f"# TYPE sglang:{name} {kind}", f"sglang:{name}{label} {float(value)}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    # ---- request control ---------------------------------------------------------------------------
    async def abort(self, request: web.Request) -> web.Response:
        try:
            body = await json_body(request)
        except BadRequest as e:
            return error_response(str(e))
        self.e.abort(str(body.get("rid") or ""), bool(body.get("abort_all", False)), "Abort request")
        return web.Response(status=200)

    async def pause(self, request: web.Request) -> web.Response:
        try:
            mode = (await json_body(request)).get("mode", "abort")
        except BadRequest as ex:
            return error_response(str(ex))
        if mode not in ("abort", "retract", "in_place"):
            return error_response(f"mode: {mode!r} is not one of 'abort', 'retract', 'in_place'")
        e = self.e
        e.holds.add(HOLD_PAUSE)
        async with e.step_lock:  # the running step finishes first
            if mode == "abort":
                e.abort("", True, "Abort by pause_generation", admitted_only=True)
            elif mode == "retract":  # back to the waiting queue: they hold no cache, a flush can succeed
                for req in e.active.values():
                    req.admitted = False
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.e.release_hold(HOLD_PAUSE)
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        try:
            timeout = max(0.0, float(request.query.get("timeout", 0.0)))
        except ValueError:
            return web.Response(status=400, text="timeout: must be a number of seconds\n")
        deadline = time.monotonic() + timeout
        while self.e.busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self.e.busy():  # held requests own no cache (SGLang ignores the waiting queue while paused)
            return web.Response(status=400, text="Cache not flushed: there are running requests.\n")
        return web.Response(status=200, text=_FLUSH_OK)

    async def release_memory(self, request: web.Request) -> web.Response:
        try:
            tags = _memory_tags(await json_body(request))
        except BadRequest as e:
            return error_response(str(e))
        if self.e.busy():
            return error_response("release_memory_occupation should be called only when server is idle.")
        self.e.released.update(tags)
        self.e.holds.add(HOLD_MEMORY)  # nothing runs on released memory: new requests wait for resume
        return web.json_response(None)

    async def resume_memory(self, request: web.Request) -> web.Response:
        try:
            tags = _memory_tags(await json_body(request))
        except BadRequest as e:
            return error_response(str(e))
        self.e.released.difference_update(tags)
        if not self.e.released:
            self.e.release_hold(HOLD_MEMORY)
        return web.json_response(None)

    # ---- weights ------------------------------------------------------------------------------------
    async def update_from_disk(self, request: web.Request) -> web.Response:
        e = self.e
        try:
            body = await json_body(request)
            path = str(body["model_path"])
        except (BadRequest, KeyError) as ex:
            return weight_response(False, f"bad request: {ex}", num_paused_requests=0)
        if body.get("abort_all_requests"):
            e.abort("", True, "Abort by update_weights_from_disk")
        async with e.step_lock:
            try:
                await asyncio.to_thread(e.model.load_checkpoint, path)
            except Exception as ex:  # noqa: BLE001 - reported to the caller, the old weights stay
                return weight_response(False, f"Failed to update weights: {ex}", num_paused_requests=0)
            e.model_path = path
            ok, msg = self._after_update(body, "Succeeded to update model weights.")
        return weight_response(ok, msg, num_paused_requests=0)

    def _after_update(self, body: dict[str, Any], message: str) -> tuple[bool, str]:
        """New weight version; SGLang's post-update flush, which fails the call while requests still run."""
        if body.get("weight_version") is not None:
            self.e.weight_version = str(body["weight_version"])
        if body.get("flush_cache", True) and self.e.busy():
            return False, ("Weights were updated, but the cache was not flushed because requests are still "
                           "running or queued. Retract or finish them, then call /flush_cache.")
        return True, message

    async def update_weight_version(self, request: web.Request) -> web.Response:
        try:
            body = await json_body(request)
            version = str(body["new_version"])
        except (BadRequest, KeyError) as ex:
            return weight_response(False, f"Failed to update weight version: {ex}")
        if body.get("abort_all_requests", True):
            self.e.abort("", True, "Abort by update_weight_version")
        self.e.weight_version = version
        return weight_response(True, f"Weight version updated to {version}", new_version=version)

    async def init_group(self, request: web.Request) -> web.Response:
        try:
            b = await json_body(request)
            args = (str(b["master_address"]), int(b["master_port"]), int(b["rank_offset"]), int(b["world_size"]),
                    str(b.get("group_name", "weight_update_group")), str(b.get("backend", "nccl")))
        except (BadRequest, KeyError, TypeError, ValueError) as ex:
            return weight_response(False, f"bad request: {ex!r}")
        name = args[4]
        if name in self.groups:  # as SGLang 0.5.23: a name is built once until destroyed
            return weight_response(False, "Failed to initialize custom process group: The specified group name has "
                                          "already been created, please use a different group name.")
        try:
            self.groups[name] = await asyncio.to_thread(WeightUpdateGroup, *args, timeout=self.e.group_timeout)
        except Exception as ex:  # noqa: BLE001 - reported as SGLang does
            return weight_response(False, f"Failed to initialize custom process group: {ex}.")
        return weight_response(True, "Succeeded to initialize custom process group.")

    async def destroy_group(self, request: web.Request) -> web.Response:
        try:
            name = str((await json_body(request)).get("group_name", "weight_update_group"))
        except BadRequest as ex:
            return weight_response(False, str(ex))
        group = self.groups.pop(name, None)
        if group is None:
            return weight_response(False, "The group to be destroyed does not exist.")
        group.close()
        return weight_response(True, "Succeeded to destroy custom process group.")

    async def begin_update(self, request: web.Request) -> web.Response:
        if self.session_open:
            return weight_response(False, "a weight-update session is already open; call end_weight_update() "
                                          "first")
        self.session_open = True
        return weight_response(True, "Success")

    async def end_update(self, request: web.Request) -> web.Response:
        if not self.session_open:
            return weight_response(False, "no weight-update session is open; call begin_weight_update() first")
        self.session_open = False
        return weight_response(True, "Success")

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        """Receive one bucket from the trainer's broadcast and load it.

        A request this engine refuses once it has the group (no session open, an unknown weight, a wrong shape)
        still receives the bucket before it answers 400: the trainer and the other engines are never left
        waiting in the broadcast.
        """
        e = self.e
        try:
            b = await json_body(request)
            names, shapes = [str(n) for n in b["names"]], [[int(d) for d in s] for s in b["shapes"]]
            dtypes = [dtype_from_name(d) for d in b["dtypes"]]
            if not len(names) == len(dtypes) == len(shapes):
                raise BadRequest(f"names / dtypes / shapes: lengths {len(names)} / {len(dtypes)} / {len(shapes)} "
                                 "differ")
        except (BadRequest, KeyError, TypeError, ValueError) as ex:
            return weight_response(False, f"bad request: {ex!r}")
        name = str(b.get("group_name", "weight_update_group"))
        group = self.groups.get(name)
        if group is None:
            return weight_response(False, f"Group {name} not in {list(self.groups)}. Please call "
                                          "`init_weights_update_group` first.")
        if b.get("abort_all_requests"):
            e.abort("", True, "Abort by update_weights_from_distributed")
        flattened = b.get("load_format") == FLATTENED_BUCKET
        async with e.step_lock:
            try:
                tensors = await asyncio.to_thread(group.receive_bucket, dtypes, shapes, flattened)
            except Exception as ex:  # noqa: BLE001 - a broken group: the update failed, the old weights stay
                return weight_response(False, f"Failed to receive weights: {ex}")
            if not self.session_open:  # refused after taking part in the broadcast (nobody is left waiting)
                return weight_response(False, "update_weights_from_distributed must run between "
                                              "begin_weight_update() and end_weight_update()")
            try:
                await asyncio.to_thread(e.model.load_weights, list(zip(names, tensors, strict=True)))
            except Exception as ex:  # noqa: BLE001 - checked before any copy: the old weights stay
                return weight_response(False, f"Failed to load weights: {ex}")
            ok, msg = self._after_update(b, "Succeeded to update parameter online.")
        return weight_response(ok, msg)

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        return weight_response(False, "/update_weights_from_tensor needs a colocated GPU engine (CUDA IPC "
                                      "handles); use /update_weights_from_distributed or /update_weights_from_disk")

    def close(self) -> None:
        for group in self.groups.values():
            group.close()
        self.groups.clear()


def _memory_tags(body: dict[str, Any]) -> set[str]:
    tags = body.get("tags") or list(MEMORY_TAGS)
    if not isinstance(tags, list) or any(t not in MEMORY_TAGS for t in tags):
        raise BadRequest(f"tags: {tags!r}; supported tags are {list(MEMORY_TAGS)}")
    return set(tags)
