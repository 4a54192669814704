"""What the real SGLang server (0.5.23) needs on a CPU-only machine beyond PyPI, in one place.

This folder is put first on ``PYTHONPATH`` of the server by ``slime_corr.engines.sglang_server`` when it runs with
``--device cpu``, so the server's main process imports this file at start-up, and the scheduler and the
detokenizer it forks (below) inherit what it did. No file of sglang is edited. It holds:

- ``sgl_kernel/``: a stand-in for sglang's kernel package, whose CPU build is not on PyPI (PyPI's is CUDA-only). A
  few sglang modules import CPU ops from it at module level and then take the torch path; the stand-in registers
  no op, so ``cpu_has_amx_support()`` is False and every layer runs ``forward_native``. Calling an op raises.
- ``torchvision/``: imported at module level by a vision-language config (``multimodal/internvl_utils.py``) that
  text models never use; PyPI's torchvision is a CUDA build that fails to import beside CPU torch.
- below: a "cpu" entry in ``sglang.srt.mem_cache.pool_host.common.ALLOC_MEMORY_FUNCS`` (host buffers, e.g. the
  routed-experts capturer of ``--enable-return-routed-experts``), which otherwise falls back to pinning memory with
  ``cudaHostRegister``. On CPU the buffer is plain host memory.
- ``_parent_watch.py``: the server stops itself when the trainer that launched it died without stopping it.
- below: the scheduler and the detokenizer are forked from the server's main process, not spawned. sglang asks for
  "spawn" (``_set_envs_and_config``), which CUDA needs; on CPU a spawned process imports sglang, torch and
  transformers again: of a tiny model's start, 23 CPU-s and 18 s (main 8.2, scheduler 8.4, detokenizer 6.7 CPU-s),
  forked 10 CPU-s and 11 s. A fork carries only the thread that forks: the children lose ``_parent_watch``'s
  thread, which only the group's leader runs anyway.
- below: no cyclic garbage collection while the server's main process imports sglang, torch and transformers (the
  collections those imports set off walked their objects again and again); right before the server forks its first
  child, one collection and what is left frozen (``gc.freeze()``), and collection is back on in both, as the
  ``gc.freeze`` documentation advises for a fork without exec: later collections skip those objects, and do not
  write to the pages the children share with the main process.
"""

import gc
import importlib.abc
import importlib.machinery
import multiprocessing
import os
import sys

_ALLOC_MODULE = "sglang.srt.mem_cache.pool_host.common"


def _alloc_plain(dims, dtype, device, pin_memory=False, allocator=None, registration_granularity_bytes=None):
    import torch

    return torch.empty(dims, dtype=dtype, device="cpu")


class _RegisterCpuAllocator(importlib.abc.MetaPathFinder):
    """Adds the "cpu" allocator entry right after sglang's host-pool module is imported."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _ALLOC_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_register(module):
            exec_module(module)
            module.ALLOC_MEMORY_FUNCS.setdefault("cpu", _alloc_plain)

        spec.loader.exec_module = exec_and_register
        return spec


sys.meta_path.insert(0, _RegisterCpuAllocator())

_set_start_method = multiprocessing.set_start_method


def _fork_instead_of_spawn(method, force=False):
    _set_start_method("fork" if method == "spawn" else method, force=force)


multiprocessing.set_start_method = _fork_instead_of_spawn  # before torch.multiprocessing copies the name


def _freeze_before_first_fork():
    if not gc.isenabled():  # the first fork: the imports are done
        gc.collect()  # their garbage; it also sets the size the collector compares later objects with
        gc.freeze()


if sys.orig_argv[1:3] == ["-m", "sglang.launch_server"]:  # the server's main process, not a helper it runs
    gc.disable()
    os.register_at_fork(before=_freeze_before_first_fork, after_in_parent=gc.enable, after_in_child=gc.enable)


import _parent_watch  # noqa: E402 - this folder is on PYTHONPATH: that is how this file is imported

_parent_watch.start()
