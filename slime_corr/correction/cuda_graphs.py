"""`--rollout-correction-cuda-graph`: the correction captured once per input shape into a CUDA graph, then replayed.

On a GPU a correction call is ~100-260 small kernels whose launches, not their work, set the wall time (an H200,
1024x8192 token TIS: 7 ms wall for 2.2 ms of GPU work). The call makes no host sync and no data-dependent shape,
so it can be captured whole and replayed with one launch:

    inputs --copy--> static inputs --replay--> outputs packed by dtype (inside the graph) --clone--> views returned

Replay costs 3 input copies, the replay and one clone per output dtype; the returned tensors are views of those
clones, so they stay valid after the next call. A graph is captured per key (the config, the shapes, dtypes and
device of the inputs, the call's options); `MAX_GRAPHS` are kept, least recently used first out, all in one memory
pool (they never run at once and their outputs are cloned, so they may share it). Pad a batch to a few length
buckets to keep the keys few, as the Megatron glue's micro-batches are.

Run eagerly instead (one warning per reason): calls with a DP / CP group of several ranks (collectives are not
captured), packed rows (`segments`), `step_bounds`, and a custom weighting function that cannot be captured (a host
sync inside it, say). On another device than CUDA the flag is an error.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from slime_corr.correction.reductions import group_size
from slime_corr.errors import ConfigError

FLAG = "--rollout-correction-cuda-graph"
MAX_GRAPHS = 16
WARMUP_CALLS = 2  # eager calls on a side stream before the capture (lazy inits, cached constants, cuBLAS handles)

# ---------------------------------------------------------------------------------------------- packing


@dataclasses.dataclass(frozen=True)
class Leaf:
    """Where a packed output lives: its dtype's buffer, offset, shape."""

    dtype: torch.dtype
    offset: int
    shape: tuple[int, ...]


def pack(tree: Any) -> tuple[dict[torch.dtype, Tensor], Any]:
    """The tensors of `tree` (a dataclass, dict, tuple or list of them, tensors, other values) flattened into one
    1-D buffer per dtype ({dtype: buffer}, one `cat` each), and the tree with `Leaf`s in their place (`unpack`)."""
    parts: dict[torch.dtype, list[Tensor]] = {}
    sizes: dict[torch.dtype, int] = {}

    def walk(x: Any) -> Any:
        if isinstance(x, Tensor):
            leaf = Leaf(x.dtype, sizes.get(x.dtype, 0), tuple(x.shape))
            parts.setdefault(x.dtype, []).append(x.detach().reshape(-1))
            sizes[x.dtype] = leaf.offset + x.numel()
            return leaf
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return dataclasses.replace(x, **{f.name: walk(getattr(x, f.name)) for f in dataclasses.fields(x)
                                             if f.init})
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, tuple | list):
            return type(x)(walk(v) for v in x)
        return x

    spec = walk(tree)
    return {dtype: torch.cat(ts) for dtype, ts in parts.items()}, spec


def unpack(buffers: dict[torch.dtype, Tensor], spec: Any) -> Any:
    """`spec` with each `Leaf` replaced by its view of `buffers` (no copy)."""
    if isinstance(spec, Leaf):
        return buffers[spec.dtype][spec.offset:spec.offset + math.prod(spec.shape)].view(spec.shape)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(spec, **{f.name: unpack(buffers, getattr(spec, f.name))
                                            for f in dataclasses.fields(spec) if f.init})
    if isinstance(spec, dict):
        return {k: unpack(buffers, v) for k, v in spec.items()}
    if isinstance(spec, tuple | list):
        return type(spec)(unpack(buffers, v) for v in spec)
    return spec


# ---------------------------------------------------------------------------------------------- capture, replay


@dataclasses.dataclass
class CapturedCall:
    """One captured call: its graph, the static inputs it reads, the packed outputs it writes."""

    graph: torch.cuda.CUDAGraph
    inputs: list[Tensor]
    outputs: dict[torch.dtype, Tensor]
    spec: Any

    def __call__(self, tensors: list[Tensor]) -> Any:
        with torch.no_grad():
            for static, x in zip(self.inputs, tensors, strict=True):
                static.copy_(x)
            self.graph.replay()
            return unpack({dtype: buf.clone() for dtype, buf in self.outputs.items()}, self.spec)


_graphs: OrderedDict[tuple, CapturedCall | None] = OrderedDict()  # None: this key cannot be captured (eager)
_pools: dict[torch.device, Any] = {}
_warned: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"{FLAG}: {reason}; those calls run eagerly.", stacklevel=3)


def _eager_reason(options: dict[str, Any]) -> str | None:
    """Why this call cannot be captured (None: it can)."""
    if group_size(options.get("cp_group")) > 1 or group_size(options.get("dp_group")) > 1:
        return "calls with a DP or CP group of several ranks (collectives are not captured)"
    if options.get("segments") is not None:
        return "packed rows (segments)"
    if options.get("step_bounds") is not None:
        return "calls with step_bounds (--rs-divergence-budget, --tis-ess-target over a step)"
    return None


def _capture(call: Callable[..., Any], tensors: list[Tensor]) -> CapturedCall:
    device = tensors[0].device
    inputs = [t.detach().clone() for t in tensors]
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(WARMUP_CALLS):
            call(*inputs)
    torch.cuda.current_stream(device).wait_stream(side)
    if device not in _pools:
        _pools[device] = torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=_pools[device]), torch.no_grad():
        outputs, spec = pack(call(*inputs))
    return CapturedCall(graph, inputs, outputs, spec)


def run(fn: Callable[..., Any], tensors: list[Tensor], config: Any, **options: Any) -> Any:
    """`fn(*tensors, config, **options)` replayed from its CUDA graph (captured on the key's first call), or run
    eagerly where it cannot be captured (see the module doc). Tensor options (e.g. `batch_norm_mean`) are inputs
    of the graph like `tensors`; the other options and `config` are part of its key."""
    device = tensors[0].device
    if device.type != "cuda":
        raise ConfigError(f"{FLAG} replays CUDA graphs: the tensors are on {device}. Leave it off on a CPU.")
    reason = _eager_reason(options)
    if reason is not None:
        _warn_once(reason)
        return fn(*tensors, config, **options)
    names = [k for k, v in options.items() if isinstance(v, Tensor)]
    fixed = {k: v for k, v in options.items() if k not in names}
    inputs = [*tensors, *(options[k] for k in names)]

    def call(*xs: Tensor) -> Any:
        return fn(*xs[:len(tensors)], config, **fixed, **dict(zip(names, xs[len(tensors):], strict=True)))

    key = (fn, config, tuple(names), tuple(sorted(fixed.items())),
           tuple((tuple(t.shape), t.dtype, t.device) for t in inputs))
    if key in _graphs:
        _graphs.move_to_end(key)
        captured = _graphs[key]
    else:
        try:
            captured = _capture(call, inputs)
        except RuntimeError as e:  # an operation that cannot be captured (a host sync in a custom function, say)
            torch.cuda.synchronize(device)
            _warn_once(f"a call could not be captured ({str(e).splitlines()[0][:200]})")
            captured = None
        _graphs[key] = captured
        while len(_graphs) > MAX_GRAPHS:
            _graphs.popitem(last=False)
    return call(*inputs) if captured is None else captured(inputs)


def clear() -> None:
    """Drop every captured graph (their memory returns to the caching allocator)."""
    _graphs.clear()
    _pools.clear()


__all__ = ["FLAG", "MAX_GRAPHS", "CapturedCall", "Leaf", "clear", "pack", "run", "unpack"]
