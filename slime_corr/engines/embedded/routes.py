"""MoE routed experts in the embedded engine, as SGLang 0.5.23 returns them (`--enable-return-routed-experts`,
request field `"return_routed_experts": true`, optional `"routed_experts_start_len"`).

What SGLang 0.5.23 does (its source, checked against the real server on CPU serving `models.tiny_moe`):
- the answer is `meta_info.routed_experts`: base64 of int32 expert ids `[seq - 1 - start_len, layers, top_k]`
  (`seq` = prompt + output tokens; the last output token is never an input of a forward), each row in the
  router's top-k order, with the finishing event only (never in an intermediate stream event);
- a token's experts are those of the forward that first computed it (its KV entry): the prefill for the prompt,
  the decode step that took it as input for an output token;
- a request that ran and was aborted (abort_request, pause in abort mode) still returns them; one aborted while
  waiting (never run, or retracted by a pause) returns none;
- without the server flag the request field is ignored (no field in the answer); with the flag and a dense model
  the server does not start; `routed_experts_start_len` outside `[0, prompt tokens]` fails the request (HTTP 400)
  whenever `return_routed_experts` is true, with or without the flag.

Here the experts come from the served Hugging Face model's own routers (each sparse layer's `mlp.gate`, which
returns `(router_logits, scores, top-k indices)` in transformers 5) during the engine's forwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class MoEShape:
    """`num_layers` sparse layers, `top_k` of `num_experts` experts per token."""

    num_layers: int
    top_k: int
    num_experts: int


class MoERouters:
    """The routers of a Hugging Face MoE causal LM (every decoder layer sparse) and a capture of their top-k."""

    def __init__(self, module: nn.Module, shape: MoEShape) -> None:
        self.routers = [m for name, m in module.named_modules() if name.endswith("mlp.gate")]
        self.shape = shape

    def problem(self) -> str | None:
        """Why the routes of this model cannot be returned (None: they can)."""
        if len(self.routers) != self.shape.num_layers:
            return (f"found {len(self.routers)} MoE routers (`*.mlp.gate`) in a model of {self.shape.num_layers} "
                    "layers: only models whose every layer is sparse are supported")
        return None

    @staticmethod
    def find(module: nn.Module) -> MoERouters | None:
        """The routers of `module` when its config describes a Mixture of Experts, else None (a dense model)."""
        cfg = getattr(module, "config", None)
        top_k = getattr(cfg, "num_experts_per_tok", None)
        experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
        if not top_k or not experts:
            return None
        return MoERouters(module, MoEShape(int(cfg.num_hidden_layers), int(top_k), int(experts)))

    @contextmanager
    def capture(self, input_ids: torch.Tensor) -> Iterator[list[torch.Tensor]]:
        """Inside the block, a forward of `input_ids` `[B, T]` leaves its routes `[B, T, layers, top_k]` (int32,
        the routers' top-k order) as the one element of the yielded list."""
        per_layer: list[torch.Tensor | None] = [None] * len(self.routers)
        out: list[torch.Tensor] = []
        k = self.shape.top_k

        def hook(i: int):
            def fn(_mod: nn.Module, _inp: object, result: object) -> None:
                if isinstance(result, tuple):  # (router_logits, scores, top-k indices)
                    ids = result[-1]
                else:  # a plain gate Linear (older transformers): the block takes top-k of the softmax
                    ids = torch.topk(torch.softmax(result.float(), dim=-1), k, dim=-1).indices
                per_layer[i] = ids.reshape(*input_ids.shape, k).to(torch.int32)
                if all(p is not None for p in per_layer):
                    out.append(torch.stack(per_layer, dim=2))  # type: ignore[arg-type]
            return fn

        handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(self.routers)]
        try:
            yield out
        finally:
            for h in handles:
                h.remove()


def routes_enabled(model: object, enable: bool) -> bool:
    """Whether an engine serving `model` returns routes: SGLang's `--enable-return-routed-experts` (`enable`),
    which needs a model whose routers it can read (else ValueError: SGLang 0.5.23 with that flag does not start on
    a dense model)."""
    routers = getattr(model, "routers", None)
    problem = routers.problem() if isinstance(routers, MoERouters) else "the model is dense (no MoE router)"
    if enable and problem is not None:
        raise ValueError(f"enable_return_routed_experts: {problem}")
    return bool(enable)


def check_start_len(start_len: int, prompt_tokens: int) -> str | None:
    """SGLang's check of `routed_experts_start_len` (its message), or None when it is in `[0, prompt_tokens]`."""
    if start_len < 0:
        return (f"recv_req.routed_experts_start_len={start_len} is lower than 0. Please use a non-negative "
                "routed_experts_start_len.")
    if start_len > prompt_tokens:
        return (f"recv_req.routed_experts_start_len={start_len} is higher than the number of input tokens "
                f"len(req.origin_input_ids)={prompt_tokens}. Please use a smaller routed_experts_start_len.")
    return None


__all__ = ["MoEShape", "MoERouters", "routes_enabled", "check_start_len"]
