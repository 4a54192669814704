"""The process group that carries weights from the trainer to the rollout engines (``/init_weights_update_group``).

Rank 0 is the trainer, ranks ``rank_offset ..`` the engines (one per engine here: no tensor parallelism). The group
lives beside any default ``torch.distributed`` group (the trainer's own ``torchrun`` world): it is built from its
own TCP store on ``master_address:master_port`` (rank 0 hosts it: ``slime_corr.ports.host_store`` binds it on a
port the OS picks, which the engines are then told) with the key prefixes SGLang's
``init_custom_process_group`` gives its group (``<group>/<group>//<device>/``), so either side can be a real
SGLang server. Backends: ``gloo`` (CPU tensors) and ``nccl`` (CUDA tensors on the device :mod:`slime_corr.device`
chose, when torch has NCCL); which one the trainer asks for is :func:`slime_corr.device.weight_sync_backend`'s.
A gloo member's connections bind its address toward the group (`gloo_address`): rank 0 the master address (the one
the others were told), another rank its address on the interface that routes to the master, not the address its
host name resolves to (which gloo would take, often loopback).

Tensors travel one bucket at a time, either one broadcast per tensor or, with ``load_format="flattened_bucket"``
(SGLang's name), the bucket's bytes concatenated into one uint8 tensor: one collective per bucket.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from slime_corr.addresses import route_source
from slime_corr.device import collective_device

BACKENDS = ("gloo", "nccl")
FLATTENED_BUCKET = "flattened_bucket"


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` / ``"torch.bfloat16"`` -> ``torch.bfloat16``; raises ValueError naming the bad dtype."""
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"dtypes: {name!r} is not a torch dtype (e.g. 'bfloat16', 'float32')")
    return dt


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the form SGLang's request carries)."""
    return str(dtype).removeprefix("torch.")


class WeightUpdateGroup:
    """One member of a weight-update group: ``broadcast`` from rank 0, bucket helpers, ``close``."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int,
                 group_name: str = "weight_update_group", backend: str = "gloo",
                 timeout: float = 600.0, store: dist.TCPStore | None = None) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend: {backend!r} is not one of {BACKENDS}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the group of world_size {world_size}")
        if not group_name:
            raise ValueError("group_name: must not be empty")
        self.rank, self.world_size, self.group_name, self.backend = rank, world_size, group_name, backend
        self.device = collective_device(backend)
        self._store: dist.Store | None = store
        self._pg = self._join(master_address, int(master_port), datetime.timedelta(seconds=timeout))

    def _join(self, master_address: str, master_port: int, timeout: datetime.timedelta) -> dist.ProcessGroup:
        """The group's backend over its own TCP store (rank 0 hosts it: the `store` it was given, else one bound on
        `master_port`), with SGLang's key prefixes."""
        nccl = getattr(dist, "ProcessGroupNCCL", None)
        if self.backend == "nccl" and (nccl is None or self.device.type != "cuda"):
            raise ValueError(f"backend 'nccl' needs CUDA and a torch built with NCCL (this process computes on "
                             f"{self.device}); use backend='gloo' on CPU")
        if self._store is None:
            try:
                self._store = dist.TCPStore(master_address, master_port, self.world_size, is_master=self.rank == 0,
                                            timeout=timeout, wait_for_workers=True)
            except (RuntimeError, OSError) as e:  # a refusal or a timeout: name the address and who could not reach it
                raise RuntimeError(f"the weight-update group's store at {master_address}:{master_port} could not be "
                                   f"reached from {route_source(master_address) or 'this host'} (rank {self.rank}): "
                                   f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from e
        store = dist.PrefixStore(f"{self.device.type}/", dist.PrefixStore(
            f"{self.group_name}/", dist.PrefixStore(self.group_name, self._store)))
        if self.backend == "gloo":
            address = gloo_address(master_address, self.rank)
            if address is None:  # no route found: gloo's own choice
                return dist.ProcessGroupGloo(store, self.rank, self.world_size, timeout)
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
            return dist.ProcessGroupGloo(store, self.rank, self.world_size, opts)
        assert nccl is not None
        opts = nccl.Options()
        opts._timeout = timeout
        return nccl(store, self.rank, self.world_size, opts)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """In-place broadcast of ``tensor`` from ``src`` to every member (blocking)."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        self._pg.broadcast([tensor], opts).wait()

    def send_bucket(self, tensors: Sequence[torch.Tensor], flattened: bool) -> None:
        """Rank 0: broadcast one bucket (each tensor, or their bytes in one uint8 tensor)."""
        if flattened:
            self.broadcast(torch.cat([t.detach().contiguous().to(self.device).reshape(-1).view(torch.uint8)
                                      for t in tensors]))
        else:
            for t in tensors:
                self.broadcast(t.detach().contiguous().to(self.device))

    def receive_bucket(self, dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]],
                       flattened: bool) -> list[torch.Tensor]:
        """Any other rank: receive one bucket sent by :meth:`send_bucket`; returns the tensors in order."""
        if not flattened:
            out = []
            for dt, shape in zip(dtypes, shapes, strict=True):
                t = torch.empty(tuple(shape), dtype=dt, device=self.device)
                self.broadcast(t)
                out.append(t)
            return out
        layout = bucket_layout(dtypes, shapes)
        flat = torch.empty(layout[-1][1] if layout else 0, dtype=torch.uint8, device=self.device)
        self.broadcast(flat)
        return [flat[a:b].view(dt).reshape(tuple(shape))
                for (a, b), dt, shape in zip(layout, dtypes, shapes, strict=True)]

    def close(self) -> None:
        """Leave the group (its store connection and backend go away)."""
        pg, self._pg = getattr(self, "_pg", None), None
        if pg is not None:
            try:
                pg.shutdown()
            except (RuntimeError, AttributeError):  # older torch, or a backend without shutdown
                pass
        self._store = None


def gloo_address(master_address: str, rank: int) -> str | None:
    """The address a gloo member of the group binds its connections to: rank 0 `master_address`, another rank its
    own address on the interface that routes to it (None when there is no route: gloo then picks)."""
    return master_address if rank == 0 else route_source(master_address)


def bucket_layout(dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Byte ranges of each tensor in a flattened bucket; raises ValueError when one is misaligned for its dtype."""
    out, offset = [], 0
    for dt, shape in zip(dtypes, shapes, strict=True):
        if any(int(d) < 0 for d in shape):
            raise ValueError(f"shapes: negative dimension in {list(shape)}")
        if offset % dt.itemsize:
            raise ValueError(f"flattened bucket: a {dt} tensor at byte offset {offset} is misaligned; order the "
                             "bucket by decreasing element size")
        size = dt.itemsize * int(torch.Size([int(d) for d in shape]).numel())
        out.append((offset, offset + size))
        offset += size
    return out


@dataclass
class Bucket:
    """Tensors sent in one ``/update_weights_from_distributed`` call."""

    names: list[str]
    tensors: list[torch.Tensor]

    @property
    def dtypes(self) -> list[str]:
        return [dtype_name(t.dtype) for t in self.tensors]

    @property
    def shapes(self) -> list[list[int]]:
        return [list(t.shape) for t in self.tensors]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def make_buckets(named_tensors: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[Bucket]:
    """Split ``(name, tensor)`` pairs into buckets of at most ``bucket_bytes`` (a larger tensor goes alone).

    Within a bucket, tensors are ordered by decreasing element size so a flattened bucket is always aligned.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes: must be positive, got {bucket_bytes}")
    buckets: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for name, t in named_tensors:
        n = t.numel() * t.element_size()
        if not buckets or size + n > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, t))
        size += n
    out = []
    for pairs in buckets:
        pairs.sort(key=lambda p: -p[1].element_size())  # stable: keeps the model order within a dtype
        out.append(Bucket([n for n, _ in pairs], [t for _, t in pairs]))
    return out
