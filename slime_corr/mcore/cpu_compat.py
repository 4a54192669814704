"""Run Megatron-Core on a CPU-only torch (tests, CI, laptops). Every CPU adaptation lives here.

Call `apply_cpu_compat()` once, after importing megatron and before building models or running a schedule.
Whether it is needed is `slime_corr.device`'s decision: it does nothing when this process computes on CUDA, so the
same code and tests run unchanged on a GPU machine. "The CPU" below is the device `slime_corr.device` chose: the
CPU, or in device checks without a GPU the device a test points it at (`device.use("meta")`), so Megatron's own
buffers follow the device there too.

What it changes (each item was measured to break on CPU torch with megatron-core 0.16):
- `torch.cuda.current_device` answers "cpu" (many Megatron buffers use it as their device);
- `get_default_causal_mask` builds the mask on CPU (it hard-codes device="cuda");
- the CUDA RNG tracker / `model_parallel_cuda_manual_seed` keep named CPU generator states instead;
- `pipeline_parallel.schedules` tensor factories turn device="cuda" into CPU (its token counter);
- `torch.cuda.current_stream()` returns a no-op stream (newer DDP versions call it in grad sync);
- `torch.cuda.synchronize()` does nothing (Megatron's timers call it);
- activation recompute (`tensor_parallel.checkpoint`): saving / restoring the CUDA generator's state does nothing
  (there is none; torch's CPU state and the tracker's states are still saved and restored);
- tied embeddings under pipeline parallelism: `LanguageModule.setup_embeddings_and_output_layer` moves the shared
  weight with `.cuda()` before the first/last-stage all-reduce: `Tensor.cuda` is the identity during that call;
- MoE routers: `moe_utils.te_general_gemm` is defined as None when TransformerEngine is absent (0.16.1 imports
  it only with TE but reads it unconditionally in `RouterGatingLinearFunction`: NameError without TE).
`apply_cpu_compat_megatron_training()` adds what Megatron-LM's loop (`megatron.training`, 0.19+) needs:
- its training module's tensor factories given device="cuda" (train_step / training_log accumulators) build on CPU;
- `validate_args` asks for the GPU architecture (with TP or CP > 1): 0 on CPU, i.e. pre-Blackwell, so it
  requires CUDA_DEVICE_MAX_CONNECTIONS=1 as on such GPUs.
Megatron's optimizer (`megatron.core.optimizer`, the mixed-precision one of `slime_corr.mcore.precision`):
- its modules' tensor factories given device="cuda" (found_inf, the loss scale, grad norms) build on CPU, and so
  does the l2-norm it uses without apex/TE (`utils.local_multi_tensor_l2_norm`);
- `Float16OptimizerWithFloat16Params.__init__` and `clip_grad_by_total_norm_fp32` read a CPU float tensor's
  `type()` as its CUDA name ('torch.cuda.BFloat16Tensor'...): they sort / assert parameters by that name;
- `DynamicGradScaler.load_state_dict` keeps the loaded scale where it is (it calls `.cuda()`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types
from collections.abc import Iterator
from typing import Any

import torch

from slime_corr import device
from slime_corr.mcore.compat import import_megatron_training, import_schedules

_APPLIED = False


def cpu_compat_needed() -> bool:
    """True when this process does not compute on CUDA (`slime_corr.device`): the adaptations are then required."""
    return device.current().needs_cpu_compat


def _host() -> str:
    """The device Megatron's "cuda" means once the adaptations are on: the one `slime_corr.device` chose ("cpu";
    "meta" in a device check), the CPU if that is CUDA."""
    placement = device.current()
    return "cpu" if placement.is_cuda else str(placement.device)


def is_cpu_compat_applied() -> bool:
    return _APPLIED


def _cpu_device(spec: Any) -> Any:
    """Map any CUDA device spec to the CPU (`_host`); leave others alone."""
    if spec is None:
        return None
    if isinstance(spec, int) or "cuda" in str(spec):
        return _host()
    return spec


class _CPUTorchProxy(types.ModuleType):
    """Stands in for `torch` inside one Megatron module: tensor factories given device="cuda" build on CPU."""

    _FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "zeros_like", "ones_like", "empty_like")

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch, name)
        if name in self._FACTORIES:

            @functools.wraps(attr)
            def factory(*args: Any, **kwargs: Any) -> Any:
                if "device" in kwargs:
                    kwargs["device"] = _cpu_device(kwargs["device"])
                return attr(*args, **kwargs)

            return factory
        return attr


class CPURNGStatesTracker:
    """CPU replacement of Megatron's `CudaRNGStatesTracker`: named CPU generator states, same interface."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.reset()

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    """CPU version of `transformer.utils.get_default_causal_mask` (True = masked out)."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool, device=_host()), diagonal=1)


def _install_rng_tracker() -> None:
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mrandom

    tracker = CPURNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    def cpu_model_parallel_seed(seed: int, *args: Any, tp_rank: int | None = None, **kwargs: Any) -> None:
        """CPU `model_parallel_cuda_manual_seed`: the same named states and TP seed offset as Megatron's."""
        from megatron.core import parallel_state

        if tp_rank is None:
            tp_rank = parallel_state.get_tensor_model_parallel_rank()
        torch.manual_seed(seed)
        tracker.reset()
        tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
        tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
        tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + 100 + tp_rank)  # ep_rank 0

    mrandom.model_parallel_cuda_manual_seed = cpu_model_parallel_seed
    tensor_parallel.model_parallel_cuda_manual_seed = cpu_model_parallel_seed


class _NoOpStream:
    def wait_stream(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _tensors_stay_on_cpu(method: Any) -> Any:
    """`method` with `Tensor.cuda` the identity while it runs."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
        try:
            return method(*args, **kwargs)
        finally:
            torch.Tensor.cuda = cuda  # type: ignore[method-assign]

    return wrapper


_CUDA_TYPE_NAMES = {torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
                    torch.bfloat16: "torch.cuda.BFloat16Tensor"}


def _tensor_types_read_as_cuda(method: Any) -> Any:
    """`method` with `Tensor.type()` (no argument) answering the CUDA type name of a float tensor while it runs:
    Megatron's optimizer sorts and checks parameters by `param.type() == 'torch.cuda.FloatTensor'` etc."""
    tensor_type = torch.Tensor.type

    def cuda_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or self.is_cuda or self.dtype not in _CUDA_TYPE_NAMES:
            return tensor_type(self, *args, **kwargs)
        return _CUDA_TYPE_NAMES[self.dtype]

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        torch.Tensor.type = cuda_type  # type: ignore[method-assign]
        try:
            return method(*args, **kwargs)
        finally:
            torch.Tensor.type = tensor_type  # type: ignore[method-assign]

    return wrapper


def _with_cpu_factories(function: Any) -> Any:
    """A copy of a Megatron module-level `function` whose `torch` is `_CPUTorchProxy` (its module keeps torch)."""
    scope = {**function.__globals__, "torch": _CPUTorchProxy()}
    return functools.wraps(function)(
        types.FunctionType(function.__code__, scope, function.__name__, function.__defaults__, function.__closure__))


def _adapt_optimizer() -> None:
    """Megatron's optimizer (`megatron.core.optimizer`: Float16OptimizerWithFloat16Params, FP32Optimizer, the
    grad scalers, gradient clipping) on the CPU: its tensor factories given device="cuda" (found_inf, the loss
    scale, norms) build on CPU; its parameter sorting and clipping read CPU float tensors as their CUDA types; a
    grad scaler's `load_state_dict` keeps the scale on CPU (`.cuda()`); the local (no apex/TE) l2-norm builds on CPU."""
    from megatron.core import utils as megatron_utils
    from megatron.core.optimizer import clip_grads, grad_scaler
    from megatron.core.optimizer import optimizer as megatron_optimizer

    for module in (megatron_optimizer, grad_scaler, clip_grads):
        module.torch = _CPUTorchProxy()
    float16_optimizer = megatron_optimizer.Float16OptimizerWithFloat16Params
    float16_optimizer.__init__ = _tensor_types_read_as_cuda(float16_optimizer.__init__)
    clip = _tensor_types_read_as_cuda(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = megatron_optimizer.clip_grad_by_total_norm_fp32 = clip
    scaler = grad_scaler.DynamicGradScaler
    scaler.load_state_dict = _tensors_stay_on_cpu(scaler.load_state_dict)
    if clip_grads.l2_norm_impl is megatron_utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = _with_cpu_factories(megatron_utils.local_multi_tensor_l2_norm)


def apply_cpu_compat() -> bool:
    """Apply the CPU adaptations once (idempotent). Returns True if they are active, False on CUDA machines."""
    global _APPLIED
    if not cpu_compat_needed():
        return False
    if _APPLIED:
        return True

    torch.cuda.current_device = _host  # type: ignore[assignment]
    torch.cuda.current_stream = lambda *a, **k: _NoOpStream()  # type: ignore[assignment]
    torch.cuda.default_stream = lambda *a, **k: _NoOpStream()  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]

    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as transformer_utils

    schedules = import_schedules()

    transformer_utils.get_default_causal_mask = _cpu_default_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_default_causal_mask
    schedules.torch = _CPUTorchProxy()
    _install_rng_tracker()
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import moe_utils

    tp_random._get_cuda_rng_state = lambda *a, **k: None
    tp_random._set_cuda_rng_state = lambda *a, **k: None

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    from megatron.core.models.common.language_module.language_module import LanguageModule

    LanguageModule.setup_embeddings_and_output_layer = _tensors_stay_on_cpu(
        LanguageModule.setup_embeddings_and_output_layer)
    _adapt_optimizer()
    _APPLIED = True
    return True


def apply_cpu_compat_megatron_training() -> bool:
    """`apply_cpu_compat()` plus Megatron-LM's training module (imports `megatron.training`). Returns True if
    the adaptations are active, False on CUDA machines."""
    if not apply_cpu_compat():
        return False

    import_megatron_training()
    training = importlib.import_module("megatron.training.training")
    if not isinstance(training.torch, _CPUTorchProxy):
        training.torch = _CPUTorchProxy()
    importlib.import_module("megatron.training.arguments").get_device_arch_version = lambda: 0
    return True


__all__ = [
    "CPURNGStatesTracker",
    "apply_cpu_compat",
    "apply_cpu_compat_megatron_training",
    "cpu_compat_needed",
    "is_cpu_compat_applied",
]
