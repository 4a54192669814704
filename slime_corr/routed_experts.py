"""Routed experts of a Mixture-of-Experts rollout: what SGLang returns and how a sample holds it (no I/O).

SGLang 0.5.23 (server flag `--enable-return-routed-experts`, request field `"return_routed_experts": true`)
answers `meta_info.routed_experts`: base64 of int32 expert ids `[prompt + output - 1, layers, top_k]`, for every
token that was an input of a forward (the last output token never was), in the order of the router's top-k.
In a stream it comes with the finishing event only. Samples keep them compactly: uint8 when there are at most
256 experts, int16 up to 32768 (`layers * top_k` bytes per token, or twice that).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

import numpy as np
import torch


class RoutedExpertsError(ValueError):
    """Routed experts that do not fit what was asked (shape, expert range, encoding)."""


@dataclass(frozen=True)
class RoutedExpertsSpec:
    """The MoE shape routes are checked against: `num_layers` MoE layers, `top_k` experts per token among
    `num_experts`."""

    num_layers: int
    top_k: int
    num_experts: int

    def __post_init__(self) -> None:
        if min(self.num_layers, self.top_k, self.num_experts) < 1 or self.top_k > self.num_experts:
            raise ValueError(f"RoutedExpertsSpec: need num_layers, top_k, num_experts >= 1 and top_k <= "
                             f"num_experts, got {self}")
        if self.num_experts > 32768:
            raise ValueError(f"RoutedExpertsSpec: num_experts={self.num_experts} > 32768 does not fit int16")

    @property
    def dtype(self) -> torch.dtype:
        """The smallest integer dtype holding every expert id: uint8 (<= 256 experts) or int16."""
        return torch.uint8 if self.num_experts <= 256 else torch.int16

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.top_k * (1 if self.dtype == torch.uint8 else 2)


def decode_routed_experts(data: object, num_tokens: int, spec: RoutedExpertsSpec) -> torch.Tensor:
    """`meta_info.routed_experts` (base64 int32) -> `[num_tokens, num_layers, top_k]` tensor of `spec.dtype`.
    Raises :class:`RoutedExpertsError` when it is not base64, not `num_tokens * layers * top_k` int32 values, or
    holds an id outside `[0, num_experts)`."""
    if not isinstance(data, str):
        raise RoutedExpertsError(f"meta_info.routed_experts: expected a base64 string, got {type(data).__name__}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RoutedExpertsError(f"meta_info.routed_experts: not base64 ({e})") from e
    per_token = spec.num_layers * spec.top_k
    if len(raw) % 4 or len(raw) // 4 != num_tokens * per_token:
        raise RoutedExpertsError(
            f"meta_info.routed_experts: {len(raw)} bytes, expected {num_tokens} tokens x {spec.num_layers} layers x "
            f"top-{spec.top_k} int32 = {4 * num_tokens * per_token} (does the server's model match {spec}?)")
    ids = np.frombuffer(raw, dtype="<i4")
    if ids.size and (ids.min() < 0 or ids.max() >= spec.num_experts):
        raise RoutedExpertsError(f"meta_info.routed_experts: expert ids in [{ids.min()}, {ids.max()}] outside "
                                 f"[0, {spec.num_experts})")
    return torch.from_numpy(ids.astype(np.int16)).to(spec.dtype).view(num_tokens, spec.num_layers, spec.top_k)


def encode_routed_experts(routes: torch.Tensor) -> str:
    """The inverse of :func:`decode_routed_experts` (tests, recorded responses): any integer tensor -> base64
    of its int32 values."""
    return base64.b64encode(routes.to(torch.int32).contiguous().numpy().astype("<i4").tobytes()).decode()


def extend_routes(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """A sample's routes after another response: `new` covers the whole new request (the sample's tokens so far,
    then the new ones); the rows `old` already has are kept (the routes those tokens were sampled with, as their
    log-probs are), the rest appended. `new` must cover at least `old`'s rows."""
    if old is None or old.shape[0] == 0:
        return new
    if new.shape[0] < old.shape[0] or new.shape[1:] != old.shape[1:] or new.dtype != old.dtype:
        raise RoutedExpertsError(f"routed_experts: a response's routes {tuple(new.shape)} {new.dtype} do not extend "
                                 f"the sample's {tuple(old.shape)} {old.dtype}")
    return torch.cat([old, new[old.shape[0]:]])


__all__ = ["RoutedExpertsError", "RoutedExpertsSpec", "decode_routed_experts", "encode_routed_experts",
           "extend_routes"]
