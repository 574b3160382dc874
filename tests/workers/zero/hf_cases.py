"""Tiny-config Hugging Face models and the per-rank runs of ``test_hf_models.py`` (importable by
spawned ranks).

Models are built from configs only (no ``from_pretrained``, no downloads: ``HF_HUB_OFFLINE`` and
``TRANSFORMERS_OFFLINE`` are set before ``transformers`` is imported), hidden 32, 2 layers,
vocabulary 128, dropout off and router noise off so that a run is deterministic. Each model
comes with a loss ``loss(model, batch)`` and a batch maker, so the engine run and the
single-process reference share every line but the engine.

[Note: what the reference is]
Data parallelism over N ranks must equal one process that sees every rank's rows: the
reference runs the model on each rank's rows separately (batch-dependent losses -- the
mixture-of-experts auxiliary losses, BatchNorm's batch statistics -- are per rank, as in the
engine run) and backpropagates the mean of the N losses, then steps a plain ``torch.optim``.
Buffers (BatchNorm's running statistics) follow DDP's rule (``broadcast_buffers``): every
forward starts from rank 0's buffers, so after training they are what rank 0's rows made of
them; the reference keeps rank 0's and discards the other ranks' updates.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

VOCAB, HIDDEN, LAYERS, SEQ, ROWS = 128, 32, 2, 8, 2  # ROWS: each rank's micro-batch
IMAGE, CLASSES = 16, 3
LR = 0.1


def _optimizer(params):
    """SGD with momentum and weight decay, not Adam: Adam divides each gradient by its own
    magnitude, so an element whose gradient is zero up to rounding (GPT-2's attention key bias:
    softmax ignores a shift of every score; a weight a few tokens barely touch) takes a full
    step in the direction of its rounding error. One process differs from itself by 1e-5 there
    when it sums the ranks' losses before backward instead of backpropagating each (measured),
    and the engine's Adam equivalence is checked on models built for it (``cases.py``); here
    the question is whether every gradient arrives, which SGD shows at rounding precision."""
    return torch.optim.SGD(params, lr=LR, momentum=0.9, weight_decay=0.01)


# -- models -------------------------------------------------------------------------------------


def _llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tied, attn_implementation="eager"))


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=4, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager"))


def _mixtral():
    """Fused experts (one 3-D parameter for all of them): an expert no token chose gets zeros."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=1,
        max_position_embeddings=64, router_jitter_noise=0.0, output_router_logits=True,
        router_aux_loss_coef=0.01, attn_implementation="eager"))


def _switch():
    """One module per expert inside each block (a ``ModuleDict``): with 8 experts, top-1 routing
    and 16 tokens per rank, some experts get no token on a rank (gradient from the other ranks
    only) and some on every rank (no gradient at all: PyTorch leaves them untouched)."""
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    return SwitchTransformersForConditionalGeneration(SwitchTransformersConfig(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=32, num_layers=LAYERS, num_decoder_layers=LAYERS,
        num_heads=4, num_experts=8, expert_capacity=64, encoder_sparse_step=1, decoder_sparse_step=1,
        router_jitter_noise=0.0, dropout_rate=0.0, relative_attention_num_buckets=8,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))


class BertUnusedPooler(nn.Module):
    """BERT with its pooler (registered, run, never in the loss) and a token head."""

    def __init__(self):
        super().__init__()
        from transformers import BertConfig, BertModel

        self.bert = BertModel(BertConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, attn_implementation="eager"), add_pooling_layer=True)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, labels):
        hidden = self.bert(input_ids=input_ids).last_hidden_state
        return F.cross_entropy(self.head(hidden).float().reshape(-1, VOCAB), labels.reshape(-1))


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=64, num_layers=LAYERS, num_decoder_layers=LAYERS,
        num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1))


def _resnet():
    from transformers import ResNetConfig, ResNetForImageClassification

    return ResNetForImageClassification(ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
        num_labels=CLASSES))


BUILDERS = {
    "llama-tied": lambda: _llama(True),
    "llama-untied": lambda: _llama(False),
    "gpt2": _gpt2,
    "mixtral": _mixtral,
    "switch": _switch,
    "bert": BertUnusedPooler,
    "t5": _t5,
    "resnet": _resnet,
}
MODELS = list(BUILDERS)
HAS_BUFFERS_THAT_TRAIN = {"resnet"}  # BatchNorm running statistics


def make(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = BUILDERS[name]()
    model.train()
    return model


# -- data and losses ----------------------------------------------------------------------------


def batches(name: str, world_size: int, steps: int, seed: int = 1) -> list[dict]:
    """``steps`` global batches (world_size·ROWS rows each), the same for reference and engine."""
    g = torch.Generator().manual_seed(seed)
    n = world_size * ROWS
    out = []
    for _ in range(steps):
        if name == "resnet":
            out.append({"pixel_values": torch.randn(n, 3, IMAGE, IMAGE, generator=g),
                        "labels": torch.randint(0, CLASSES, (n,), generator=g)})
        else:
            out.append({"input_ids": torch.randint(2, VOCAB, (n, SEQ), generator=g),
                        "labels": torch.randint(2, VOCAB, (n, SEQ), generator=g)})
    return out


def rank_rows(batch: dict, rank: int) -> dict:
    return {k: v[rank * ROWS:(rank + 1) * ROWS] for k, v in batch.items()}


def loss_of(model, name: str, batch: dict) -> torch.Tensor:
    """The rank's loss; ``model`` is the module or the engine (both are called the same way)."""
    if name == "bert":
        return model(batch["input_ids"], batch["labels"])
    return model(**batch).loss.float()


# -- the reference and the engine run -----------------------------------------------------------


def reference(name: str, world_size: int, steps: int):
    """One process, plain SGD, every rank's rows (see the note): final state dict, losses."""
    model = make(name)
    optimizer = _optimizer([p for p in model.parameters() if p.requires_grad])
    losses = []
    for batch in batches(name, world_size, steps):
        kept = None
        start = {k: b.clone() for k, b in model.named_buffers()}
        per_rank = []
        for r in range(world_size):
            _restore(model, start)  # DDP: every rank's forward starts from rank 0's buffers
            per_rank.append(loss_of(model, name, rank_rows(batch, r)))
            if r == 0:
                kept = {k: b.clone() for k, b in model.named_buffers()}
        _restore(model, kept)
        loss = sum(per_rank) / world_size
        loss.backward()
        losses.append([x.item() for x in per_rank])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def _restore(model: nn.Module, values: dict) -> None:
    """Buffers that changed back to ``values``, by replacing the tensor: BatchNorm's backward saved
    the running statistics, and an in-place write would invalidate that graph."""
    for mod_name, module in model.named_modules():
        for b_name, b in list(module._buffers.items()):
            key = f"{mod_name}.{b_name}" if mod_name else b_name
            if b is not None and not torch.equal(b, values[key]):
                module._buffers[b_name] = values[key].clone()


def engine_run(rank: int, world_size: int, name: str, stage: int, precision: str, steps: int):
    """One rank's run; returns (full_state_dict, this rank's losses, unit names) or the error."""
    from workers.zero import ZeroConfig, ZeroEngine

    model = make(name, seed=rank)  # rank 0's values must win: the engine broadcasts them
    try:
        engine = ZeroEngine(model, _optimizer, ZeroConfig(stage=stage, precision=precision))
        losses = []
        for batch in batches(name, world_size, steps):
            loss = loss_of(engine, name, rank_rows(batch, rank))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        units = [u.name for u in engine.strategy.units] if stage == 3 else []
        full = engine.full_state_dict()
        engine.remove_hooks()
        return {"full": full, "losses": losses, "units": units}
    except Exception as e:  # noqa: BLE001 -- reported per case; a defect of one model must not hide the rest
        return {"error": f"{type(e).__name__}: {e}"}


def world(rank: int, world_size: int, cases: list[tuple[str, int, str, int]]):
    """Every (model, stage, precision, steps) case in one spawned world, in order."""
    import transformers

    transformers.logging.set_verbosity_error()
    return [engine_run(rank, world_size, *case) for case in cases]
