"""The model served by the local engine: a tiny causal LM in plain torch, and the protocols the engine needs.

The engine needs a model (:class:`EngineModel`: ``logits(input_ids) -> [B, T, V]``, weights loaded from a
checkpoint directory or from named tensors, and read back by name) and a tokenizer (:class:`Tokenizer`:
``encode`` / ``decode``, the byte-level :class:`ByteTokenizer` by default; a Hugging Face tokenizer satisfies the
protocol as it is). :class:`TorchEngineModel` adapts any ``nn.Module`` built by a factory from a checkpoint
directory and runs it in a chosen dtype (bf16 by default, so its log-probs differ from an fp32 training forward
by a small, real amount) on the device :mod:`slime_corr.device` chose. :class:`TinyCausalLM` is the default model: a GPT-style decoder with learned absolute
positions over a byte vocabulary (256 ids, id 0 doubles as EOS).
"""

from __future__ import annotations

import importlib
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from slime_corr.device import current, place_module
from slime_corr.engines.embedded.routes import MoERouters

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.pt"
# Names the factory that builds the module a checkpoint directory holds (a trainer's checkpoint of another
# architecture than TinyCausalLM): {"factory": "slime_corr.<module>:<function>", ...}, read by `load_served_module`.
ENGINE_MODULE_FILE = "engine_module.json"


@runtime_checkable
class EngineModel(Protocol):
    """What the local engine serves: logits for a right-padded batch, and ways to replace its weights.

    ``eos_token_id``: one id, several (Llama 3 style), or None. ``load_weights`` is the in-place update of
    ``/update_weights_from_distributed``: it copies each tensor into the weight of that name, casting to the
    served dtype (exactly what loading the same tensors from disk gives), and raises ``KeyError`` /
    ``ValueError`` naming an unknown weight or a wrong shape before changing anything. ``device``: where the
    model computes; the engine builds its token ids there.
    """

    vocab_size: int
    eos_token_id: int | list[int] | None
    max_seq_len: int
    device: torch.device

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` [B, T] int64 -> float32 logits [B, T, V] (causal: row t sees tokens <= t)."""
        ...

    def load_checkpoint(self, checkpoint_dir: str) -> None:
        """Replace the weights with those saved in ``checkpoint_dir``."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``(name, tensor)`` pairs into the served weights (all checked first, then all copied)."""
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The served weights by name (views, in the served dtype)."""
        ...


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token ids for ``/generate``'s ``text`` input and the ``text`` it returns.

    A Hugging Face ``PreTrainedTokenizer`` satisfies it as it is (``encode`` adds its special tokens, as SGLang's
    tokenization of ``text`` does).
    """

    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class ByteTokenizer:
    """The default tokenizer: UTF-8 bytes are the ids (0..255; ids >= 256 decode to nothing).

    It defines no EOS of its own: the model's config does (id 0 for :class:`TinyCausalLM`).
    """

    eos_token_id: int | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def eos_ids(*sources: int | list[int] | tuple[int, ...] | None) -> set[int]:
    """The union of EOS ids given as an int, a list of ints or None (model config, tokenizer...)."""
    out: set[int] = set()
    for s in sources:
        if s is None:
            continue
        out.update(int(t) for t in (s if isinstance(s, list | tuple) else [s]))
    return out


@dataclass
class TinyLMConfig:
    """Hyper-parameters of :class:`TinyCausalLM` (saved as ``config.json`` next to the weights)."""

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    ffn_size: int = 256
    max_seq_len: int = 256
    tie_embeddings: bool = True
    eos_token_id: int | None = 0
    seed: int = 0


class _Block(nn.Module):
    def __init__(self, cfg: TinyLMConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.ln1 = nn.LayerNorm(cfg.hidden_size)
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.ln2 = nn.LayerNorm(cfg.hidden_size)
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.ffn_size)
        self.fc2 = nn.Linear(cfg.ffn_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (z.view(b, t, self.num_heads, h // self.num_heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyCausalLM(nn.Module):
    """A small GPT-style decoder: token + learned position embeddings, pre-LN blocks, (tied) LM head."""

    def __init__(self, cfg: TinyLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.hidden_size)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        with torch.no_grad():  # deterministic init from the config's seed, independent of the global RNG
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif "ln" in name:
                    p.fill_(1.0)
                else:
                    std = 0.3 if name.startswith(("embed", "pos")) else 1.0 / math.sqrt(p.shape[-1])
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] token ids -> [B, T, V] logits (in the parameters' dtype)."""
        t = input_ids.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len {self.cfg.max_seq_len}")
        x = self.embed(input_ids) + self.pos(torch.arange(t, device=input_ids.device))
        for blk in self.blocks:
            x = blk(x)
        x = self.ln_f(x)
        return x @ self.embed.weight.t() if self.head is None else self.head(x)


def save_checkpoint(model: TinyCausalLM, checkpoint_dir: str) -> str:
    """Save ``model`` as ``checkpoint_dir/{config.json, model.pt}``; returns the directory."""
    os.makedirs(checkpoint_dir, exist_ok=True)
    with open(os.path.join(checkpoint_dir, CONFIG_FILE), "w") as f:
        json.dump(asdict(model.cfg), f, indent=1)
    tmp = os.path.join(checkpoint_dir, WEIGHTS_FILE + ".tmp")
    torch.save({k: v.detach().float().cpu() for k, v in model.state_dict().items()}, tmp)
    os.replace(tmp, os.path.join(checkpoint_dir, WEIGHTS_FILE))  # atomic: a reader never sees half a file
    return checkpoint_dir


def load_tiny_lm(checkpoint_dir: str) -> TinyCausalLM:
    """Build a :class:`TinyCausalLM` from a checkpoint directory written by :func:`save_checkpoint`."""
    with open(os.path.join(checkpoint_dir, CONFIG_FILE)) as f:
        cfg = TinyLMConfig(**json.load(f))
    model = TinyCausalLM(cfg)
    state = torch.load(os.path.join(checkpoint_dir, WEIGHTS_FILE), map_location="cpu", weights_only=True)
    model.load_state_dict(state)
    return model.eval()


def write_engine_module_file(checkpoint_dir: str | os.PathLike[str], factory: str, **fields: object) -> None:
    """Say which factory builds the module of `checkpoint_dir` (`ENGINE_MODULE_FILE`; `fields` for the factory)."""
    with open(os.path.join(checkpoint_dir, ENGINE_MODULE_FILE), "w") as f:
        json.dump({"factory": factory, **fields}, f, indent=1)


def load_served_module(checkpoint_dir: str) -> nn.Module:
    """The module of any checkpoint directory an embedded engine serves: the factory its `ENGINE_MODULE_FILE` names
    (a module of this package only: the file is data, not a plugin path), else a :class:`TinyCausalLM`. A
    standalone engine (``python -m slime_corr.engines.embedded.engine``) then serves what the trainer pushes."""
    path = os.path.join(checkpoint_dir, ENGINE_MODULE_FILE)
    if not os.path.exists(path):
        return load_tiny_lm(checkpoint_dir)
    with open(path) as f:
        factory = json.load(f).get("factory")
    module_name, _, attr = str(factory).partition(":")
    if not (module_name.startswith("slime_corr.") and attr):
        raise ValueError(f"{path}: factory must be 'slime_corr.<module>:<function>', got {factory!r}")
    return getattr(importlib.import_module(module_name), attr)(checkpoint_dir)


def create_tiny_checkpoint(checkpoint_dir: str, seed: int = 0, **config: int | bool | None) -> str:
    """Write a freshly initialised :class:`TinyCausalLM` (deterministic from ``seed``) to ``checkpoint_dir``."""
    return save_checkpoint(TinyCausalLM(TinyLMConfig(seed=seed, **config)), checkpoint_dir)


class TorchEngineModel:
    """Adapts an ``nn.Module`` built by ``factory(checkpoint_dir)`` to :class:`EngineModel`.

    The module's weights are cast to ``dtype`` (bf16 by default: the rollout's numeric path differs from an
    fp32 training forward) and moved to the device of :mod:`slime_corr.device` (``device``); logits are returned
    as float32, on that device. The factory must return a module mapping [B, T] ids
    to [B, T, V] logits (a tensor, or an output with ``.logits`` as Hugging Face causal LMs return) with a config
    as ``cfg`` or ``config`` giving ``vocab_size``, ``eos_token_id`` (int, list or None) and ``max_seq_len`` or
    ``max_position_embeddings``. Weight names are the module's ``state_dict`` keys. A Mixture-of-Experts module (its
    config has ``num_experts_per_tok``) also gives the experts its routers pick (:meth:`logits_and_routes`).
    """

    def __init__(
        self,
        checkpoint_dir: str,
        factory: Callable[[str], nn.Module] = load_served_module,
        dtype: torch.dtype = torch.bfloat16,
        num_threads: int | None = None,
    ) -> None:
        self.factory = factory
        self.dtype = dtype
        self.num_threads = num_threads
        self.checkpoint_dir = ""
        self.load_checkpoint(checkpoint_dir)

    def load_checkpoint(self, checkpoint_dir: str) -> None:
        """Rebuild the module from ``checkpoint_dir`` (the engine's /update_weights_from_disk)."""
        module = place_module(self.factory(checkpoint_dir).to(self.dtype)).eval()
        self.device = current().device
        cfg = getattr(module, "cfg", None) or getattr(module, "config", None)
        self.vocab_size = int(getattr(cfg, "vocab_size", 0))
        self.eos_token_id = getattr(cfg, "eos_token_id", None)
        self.max_seq_len = int(getattr(cfg, "max_seq_len", None) or getattr(cfg, "max_position_embeddings", None)
                               or 1 << 30)
        self.module = module
        self.routers = MoERouters.find(module)  # None: a dense model
        self.checkpoint_dir = checkpoint_dir

    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] -> float32 [B, T, V], computed in ``self.dtype``."""
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        out = self.module(input_ids)
        return getattr(out, "logits", out).float()

    def logits_and_routes(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`logits` and the MoE routes of the same forward: int32 ``[B, T, layers, top_k]``, each layer's
        experts in its router's top-k order (:class:`~.routes.MoERouters`; a dense model raises ValueError)."""
        if self.routers is None:
            raise ValueError("logits_and_routes: the served model is dense (no MoE router)")
        with self.routers.capture(input_ids) as routes:
            logits = self.logits(input_ids)
        return logits, routes[0]

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The module's ``state_dict`` tensors (views sharing the served storage)."""
        for name, t in self.module.state_dict().items():
            if isinstance(t, torch.Tensor):
                yield name, t

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors into the weights of the same names, cast to ``self.dtype`` (the disk path's cast)."""
        served = dict(self.named_weights())
        pairs = list(named_tensors)
        for name, t in pairs:
            if name not in served:
                raise KeyError(f"weight {name!r}: not a weight of the served model (e.g. {next(iter(served))!r})")
            if tuple(t.shape) != tuple(served[name].shape):
                raise ValueError(f"weight {name!r}: shape {tuple(t.shape)} != served {tuple(served[name].shape)}")
        for name, t in pairs:
            served[name].copy_(t)


def teacher_forced_logprobs(
    model: nn.Module, prompt: list[int], response: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """Reference log-probs of ``response`` given ``prompt`` in one forward of ``model`` (SGLang's semantics).

    Returns float32 [len(response)] on the model's device: ``log_softmax(logits / T)`` of each response token (raw
    logits if T == 0).
    """
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + response], dtype=torch.long, device=device)
    with torch.no_grad():
        logits = model(ids)[0, len(prompt) - 1 : -1].float()
    if temperature > 0:
        logits = logits / temperature
    lp = torch.log_softmax(logits, dim=-1)
    return lp.gather(-1, ids[0, len(prompt):].unsqueeze(-1)).squeeze(-1)
