"""Built-in GPT presets and user model factories.

Jobs name a model by preset (``{"preset": NAME}``, ``contract.presets``), by a Hugging Face
model directory (``{"hf": URI}``, ``workers.hf_models``) or by a factory
(``{"factory": "pkg.mod:fn", "kwargs": {...}}``): the job spec's ``model`` block, a
``contract.spec.ModelSpec``. The GPT here is a plain GPT-2 style decoder
(learned positions, pre-LayerNorm blocks in a ``ModuleList`` named ``blocks``, tied input and
output embeddings) so that the ZeRO engine, the planner and the benchmarks all see the same
shapes real users train: a tied parameter, many equal transformer blocks, a large embedding.
"""

from __future__ import annotations

import hashlib
import importlib
import math
from dataclasses import replace
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from contract.presets import PRESETS, GPTConfig
from contract.spec import ModelSpec

__all__ = ["GPT", "GPTConfig", "PRESETS", "build_model", "num_parameters", "preset_config", "resolve_factory"]


# The presets' names and shapes are contract.presets (the control plane reads them without torch).


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd ({cfg.n_embd}) must be divisible by n_head ({cfg.n_head})")
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """``forward(idx)`` returns logits; ``forward(idx, targets)`` returns the mean loss."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one parameter, used twice
        # [Note: one seed, one model] Every parameter's values come from a generator seeded by
        # (the seed in force at construction, the parameter's name), not from the global RNG
        # stream, so the order modules are initialized in does not matter: built eagerly here,
        # or on the meta device and materialized unit by unit by the engine (which calls
        # ``init_weights(module)``), a seed gives the same bits.
        self.init_seed = torch.initial_seed()
        self.__dict__["_names"] = {id(p): n for n, p in self.named_parameters()}  # plain dict, not state
        if not any(p.is_meta for p in self.parameters()):
            for module in self.modules():
                self.init_weights(module)

    @torch.no_grad()
    def init_weights(self, module: nn.Module) -> None:
        """Initialize ``module``'s own parameters (GPT-2's scheme), each from its own generator.

        Linear and Embedding weights ~ N(0, 0.02), residual projections (``*proj.weight``)
        ~ N(0, 0.02/sqrt(2·n_layer)), biases 0, LayerNorm gains 1. A tied parameter is
        initialized by the module it is first registered by (``wte`` for the embedding/head).
        """
        std_proj = 0.02 / math.sqrt(2 * self.config.n_layer)
        for local, p in module._parameters.items():
            name = self._names.get(id(p)) if p is not None else None
            if name is None or self.get_submodule(name.rpartition(".")[0]) is not module:
                continue  # not ours, or registered first by another module, which initializes it
            if isinstance(module, nn.LayerNorm):
                p.fill_(1.0 if local == "weight" else 0.0)
            elif local == "bias":
                p.zero_()
            else:
                std = std_proj if name.endswith("proj.weight") else 0.02
                p.copy_(_seeded_normal(self.init_seed, name, p.shape, std))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.config.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def _seeded_normal(seed: int, name: str, shape: torch.Size, std: float) -> torch.Tensor:
    """N(0, std) values for parameter ``name``, from a CPU generator seeded by (seed, name)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return torch.normal(0.0, std, size=tuple(shape), generator=gen)


def num_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Φ: unique parameters (a tied weight counts once, as ``model.parameters()`` yields it)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: 6·Φ for the matmuls plus attention's 12·L·d·T (PaLM appendix B)."""
    flops = 6.0 * num_parameters(model)
    cfg = getattr(model, "config", None)
    if isinstance(cfg, GPTConfig):
        flops += 12.0 * cfg.n_layer * cfg.n_embd * seq_len
    elif isinstance(getattr(cfg, "num_hidden_layers", None), int) and isinstance(getattr(cfg, "hidden_size", None), int):
        flops += 12.0 * cfg.num_hidden_layers * cfg.hidden_size * seq_len  # an HF config (gpt2's maps its names)
    return flops


def resolve_factory(path: str) -> Callable[..., Any]:
    """Import ``"pkg.mod:fn"``; raise ValueError with the path when it cannot be found."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"factory must look like 'package.module:function', got {path!r}")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import factory {path!r}: {exc}") from exc
    if not callable(obj):
        raise ValueError(f"factory {path!r} is not callable")
    return obj


def preset_config(name: str, **overrides: Any) -> GPTConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)


def build_model(model_spec: ModelSpec | Mapping[str, Any]) -> nn.Module:
    """Build the model a job spec's ``model`` block names (on the current default device).

    [Note: a plain mapping is validated here]
    The training loop passes the typed ``spec.model``. The planner also builds models from a
    model block it keeps frozen (its cache key, ``planner.model_key``), so a mapping is
    accepted and validated into a ``ModelSpec`` first -- the same rules, and the same
    defaults, as every other reader.
    """
    model = ModelSpec.model_validate(model_spec)  # an instance comes back as it is
    if model.preset is not None:
        return GPT(preset_config(model.preset))
    if model.hf is not None:  # parameters on meta whatever the device (workers.hf_models)
        from workers.hf_models import build_hf_model

        return build_hf_model(model.hf)
    return resolve_factory(model.factory)(**model.kwargs)
