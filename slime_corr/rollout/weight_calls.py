"""The client's weight-update calls: new weights to every live worker, from a checkpoint on disk or over a process
group, and the check that each worker then reports the expected weight version.

Each call fans out through a control plane like every control call (:class:`~slime_corr.rollout.control.ControlPlane`:
all live workers or a :class:`~slime_corr.rollout.control.ControlError`), with a bound that grows with the bytes it
carries (:func:`weight_call_timeout`). The client holds its :class:`WeightCalls` as ``client.weights``, over its
own control plane. What the trainer does around them (buckets, the group's life) is
:mod:`slime_corr.rollout.weight_sync`'s.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from slime_corr.rollout.control import ControlError, ControlPlane, check_sync_pause_mode

# A weight update may take the client's control_timeout plus this per GB it carries: loading from disk or receiving a
# broadcast, then copying into the model, runs at >= 1 GB/s on GPU servers and at tens of MB/s on a loaded CPU one.
WEIGHT_LOAD_S_PER_GB = 30.0


def weight_call_timeout(control_timeout: float, nbytes: int) -> float:
    """The bound of a weight call carrying `nbytes`: the control calls' bound plus WEIGHT_LOAD_S_PER_GB per GB."""
    return control_timeout + WEIGHT_LOAD_S_PER_GB * nbytes / 1e9


class WeightCalls:
    """The weight calls, each sent to the live workers of ``control`` (its timeout the base of their bounds)."""

    def __init__(self, control: ControlPlane) -> None:
        self.control = control

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, flush_cache: bool = True,
        load_format: str | None = None,
    ) -> None:
        """``POST /update_weights_from_disk`` on every live worker; raises unless all report success.

        ``model_path`` must be a folder here (the servers share this file system for disk sync): SGLang takes a
        path it cannot find for a Hugging Face Hub name and answers 400 "Name or service not known"."""
        if not os.path.isdir(model_path):
            raise FileNotFoundError(f"update_weights_from_disk: model_path {model_path!r} is not a folder on this "
                                    "machine; write the checkpoint there first (SGLang would take the path for a "
                                    "Hub model name).")
        payload: dict[str, Any] = {"model_path": model_path, "flush_cache": flush_cache}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        if load_format is not None:
            payload["load_format"] = load_format
        timeout = weight_call_timeout(self.control.timeout, _folder_bytes(model_path))
        done = await self.control.fan_out("/update_weights_from_disk", payload, weight_call=True, timeout=timeout)
        if weight_version is not None:
            await self.check_weight_version("/update_weights_from_disk", weight_version, list(done))

    async def check_weight_version(self, path: str, expected: str, workers: Sequence[str]) -> None:
        """Raise ControlError unless every worker of `workers` reports ``expected`` as its weight version
        (``/model_info``): a server that answered a weight update with success without applying it is found here."""
        wrong = {w: v for w, v in (await self.control.weight_versions(workers)).items() if v != expected}
        if wrong:
            raise ControlError(path, {w: f"answered success, but then reports weight version {v!r}, not "
                                         f"{expected!r}: the server did not apply the update" for w, v in wrong.items()},
                               [w for w in workers if w not in wrong])

    async def sync_weights_from_disk(self, model_path: str, weight_version: str, pause_mode: str = "abort") -> None:
        """The usual sequence: pause -> update from disk -> flush_cache (retried) -> continue (always)."""
        check_sync_pause_mode(pause_mode)

        async def update() -> None:
            await self.update_weights_from_disk(model_path, weight_version, flush_cache=False)
            await self.control.flush_cache()

        await self.control.while_paused(update, pause_mode)

    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int = 1, world_size: int | None = None,
        group_name: str = "weight_update_group", backend: str = "nccl", workers: Sequence[str] | None = None,
    ) -> dict[str, int]:
        """``POST /init_weights_update_group`` to each worker with its own rank: ``rank_offset + i`` for the i-th
        (rank 0 is the trainer); ``world_size`` defaults to ``rank_offset + number of workers``.

        Blocks until every member joined: run the trainer's side of the group concurrently.
        """
        ws = list(workers) if workers is not None else await self.control.workers()
        ranks = {w: rank_offset + i for i, w in enumerate(ws)}
        await self.control.fan_out("/init_weights_update_group", lambda w: {
            "master_address": master_address, "master_port": master_port, "rank_offset": ranks[w],
            "world_size": world_size or rank_offset + len(ws), "group_name": group_name, "backend": backend},
            workers=ws, weight_call=True)
        return ranks

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group",
                                           workers: Sequence[str] | None = None) -> None:
        await self.control.fan_out("/destroy_weights_update_group", {"group_name": group_name}, workers=workers)

    async def begin_weight_update(self, workers: Sequence[str] | None = None) -> None:
        """``/begin_weight_update`` (SGLang 0.5.23 needs it around distributed updates; older servers: 404, ok)."""
        await self.control.fan_out("/begin_weight_update", {}, workers=workers, allow_404=True)

    async def end_weight_update(self, workers: Sequence[str] | None = None) -> None:
        await self.control.fan_out("/end_weight_update", {}, workers=workers, allow_404=True)

    async def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]],
        group_name: str = "weight_update_group", flush_cache: bool = False, weight_version: str | None = None,
        load_format: str | None = None, workers: Sequence[str] | None = None, nbytes: int = 0,
    ) -> dict[str, Any]:
        """``POST /update_weights_from_distributed``: the workers receive the tensors (``nbytes`` in all, which
        sets the call's bound) by broadcast from rank 0."""
        payload: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                                   "flush_cache": flush_cache}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        if load_format is not None:
            payload["load_format"] = load_format
        timeout = weight_call_timeout(self.control.timeout, nbytes)
        done = await self.control.fan_out("/update_weights_from_distributed", payload, workers=workers,
                                          weight_call=True, timeout=timeout)
        if weight_version is not None:
            await self.check_weight_version("/update_weights_from_distributed", weight_version, list(done))
        return done


def _folder_bytes(path: str) -> int:
    """Bytes of the files in the folder `path` (not recursive: a checkpoint's weight files)."""
    with os.scandir(path) as entries:
        return sum(e.stat().st_size for e in entries if e.is_file())
