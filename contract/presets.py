"""The built-in GPT presets: one table of names and shapes, read by the models, the spec and the dashboard.

A preset's parameter count Φ and its context (the longest sequence its position table holds)
follow from the shape by arithmetic, so the control plane knows them without torch. The model
code (``workers.models.GPT``) builds exactly these shapes; a test builds every preset on the
meta device and checks Φ.
"""

from __future__ import annotations

from dataclasses import dataclass

BYTE_VOCAB = 256  # a vocabulary of bytes: the presets', synthetic data's, the planner's for a model without one


@dataclass(frozen=True)
class GPTConfig:
    """The shape of a GPT-2 style decoder (``workers.models.GPT``)."""

    vocab_size: int = BYTE_VOCAB
    block_size: int = 256  # longest sequence the position table holds
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True

    @property
    def context(self) -> int:
        return self.block_size

    @property
    def parameters(self) -> int:
        """Φ: unique parameters, the tied input/output embedding counted once.

        Per block: two LayerNorms (2d each with bias), qkv (3d² + 3d), attention projection
        (d² + d), MLP (4d² + 4d and 4d² + d); then the token and position tables and the final
        LayerNorm. Biases and LayerNorm shifts vanish with ``bias=False``.
        """
        d, bias = self.n_embd, int(self.bias)
        norm = d * (1 + bias)
        block = 2 * norm + (3 * d * d + 3 * d * bias) + (d * d + d * bias) + (4 * d * d + 4 * d * bias) + (4 * d * d + d * bias)
        return self.vocab_size * d + self.block_size * d + self.n_layer * block + norm

    def state_dict_shapes(self) -> list[tuple[list[str], tuple[int, ...]]]:
        """``workers.models.GPT(self).state_dict()`` as ``(names, shape)``, one entry per distinct
        tensor in state_dict order, a tied tensor's names together (the shape of
        ``workers.checkpointing.pretrained.expected_tensors``): the control plane checks a
        ``model.init_from`` against it without torch. A test compares it with the real model."""
        d, v = self.n_embd, self.vocab_size

        def linear(name: str, fan_in: int, fan_out: int) -> list[tuple[list[str], tuple[int, ...]]]:
            weight = [([f"{name}.weight"], (fan_out, fan_in))]
            return weight + ([([f"{name}.bias"], (fan_out,))] if self.bias else [])

        def norm(name: str) -> list[tuple[list[str], tuple[int, ...]]]:
            return [([f"{name}.weight"], (d,))] + ([([f"{name}.bias"], (d,))] if self.bias else [])

        out = [(["wte.weight", "lm_head.weight"], (v, d)), (["wpe.weight"], (self.block_size, d))]
        for i in range(self.n_layer):
            block = f"blocks.{i}"
            out += norm(f"{block}.ln1") + linear(f"{block}.attn.qkv", d, 3 * d) + linear(f"{block}.attn.proj", d, d)
            out += norm(f"{block}.ln2") + linear(f"{block}.mlp.fc", d, 4 * d) + linear(f"{block}.mlp.proj", 4 * d, d)
        return out + norm("ln_f")


PRESETS: dict[str, GPTConfig] = {
    # byte-level vocabularies for the small ones: they train on text as bytes.
    "gpt-nano": GPTConfig(vocab_size=256, block_size=256, n_layer=5, n_head=4, n_embd=128),
    "gpt-mini": GPTConfig(vocab_size=256, block_size=256, n_layer=6, n_head=6, n_embd=384),
    # GPT-2 shapes (vocabulary padded to a multiple of 64) for the large ones.
    "gpt-small": GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt-medium": GPTConfig(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
    "gpt-1b": GPTConfig(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=2048),
}
