"""The loop's token-weighted loss: 2 Gloo ranks at stage 3 equal one process on the global token mean.

Rows of different lengths with masked prompts and padding (``IGNORE_INDEX`` targets) give the
ranks and micro-batches different numbers of trained tokens, so a mean of per-rank means would
differ from the one-process loss: the test checks that it does, and that the run does not.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from contract.spec import DataSpec, JobSpec
from tests.workers.data_parts import (
    DOCUMENTS,
    PAIRS,
    train_tokenizer,
    write_jsonl,
    write_parquet,
)
from workers.data import build_dataset
from workers.loop_config import LoopConfig
from workers.loss import (
    IGNORE_INDEX,
    StepLoss,
    count_targets,
    logits_of,
    token_loss_sum,
)
from workers.models import build_model
from workers.train import run_local

SEQ_LEN = 16
STEPS = 4
WORLD = 2


def masked_rows(rows: int = 64, vocab: int = 256, seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, target) pairs shaped like SFT rows: a prompt (masked), a completion, then padding (masked)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        length = int(torch.randint(3, SEQ_LEN + 2, (1,), generator=gen))  # tokens in the row, <= seq_len + 1
        prompt = int(torch.randint(1, length - 1, (1,), generator=gen))
        ids = torch.zeros(SEQ_LEN + 1, dtype=torch.long)
        ids[:length] = torch.randint(vocab, (length,), generator=gen)
        targets = ids[1:].clone()
        targets[:prompt - 1] = IGNORE_INDEX  # predicting prompt tokens is not trained
        targets[length - 1:] = IGNORE_INDEX  # nor padding
        out.append((ids[:-1], targets))
    return out


def job(stage: int = 3) -> dict:
    return {"name": "loss", "model": {"preset": "gpt-nano"},
            "data": {"factory": "tests.workers.test_loss:masked_rows", "seq_len": SEQ_LEN},
            "train": {"steps": STEPS, "global_batch_size": 8, "micro_batch_size": 2, "lr": 2e-3,
                      "schedule": "constant", "weight_decay": 0.0, "grad_clip": None, "seed": 0},
            "zero": {"stage": stage, "precision": "fp32"}, "resources": {"num_workers": WORLD},
            "eval": {"every_steps": STEPS, "batches": 2,
                     "data": {"factory": "tests.workers.test_loss:masked_rows", "seq_len": SEQ_LEN}}}


def reference_losses(spec: JobSpec, weighting: str, steps: int = STEPS) -> tuple[list[float], float]:
    """One process, the same model init, global batches and AdamW; the loss is the global token
    mean (``token``) or, the common mistake, the mean of each rank's own token mean (``per_rank``).
    Also the token mean of the trained model over the evaluation's samples (the first 8)."""
    torch.manual_seed(spec.train.seed)
    model = build_model(spec.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.train.lr, weight_decay=0.0,
                                  **spec.train.optimizer_options())  # the spec's betas and eps
    dataset = build_dataset(spec.data, seed=spec.train.seed)
    batch = spec.train.global_batch_size
    losses = []
    for step in range(steps):
        samples = [dataset.sample(i) for i in range(step * batch, (step + 1) * batch)]
        inputs = torch.stack([x for x, _ in samples])
        targets = torch.stack([y for _, y in samples])
        per_token = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                                    reduction="none").view(batch, -1)
        if weighting == "token":
            loss = per_token.sum() / count_targets(targets)
        else:
            ranks = zip(per_token.chunk(WORLD), targets.chunk(WORLD))
            loss = sum(p.sum() / count_targets(t) for p, t in ranks) / WORLD
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    evaluated = [dataset.sample(i) for i in range(2 * 2 * WORLD)]  # batches × micro × world
    targets = torch.stack([y for _, y in evaluated])
    with torch.no_grad():
        eval_loss = float(token_loss_sum(model(torch.stack([x for x, _ in evaluated])), targets)) \
            / count_targets(targets)
    return losses, eval_loss


def test_two_ranks_at_stage_3_train_on_the_global_token_mean_like_one_process(tmp_path):
    spec = job()
    summaries = run_local(LoopConfig(spec=spec, job_id="loss", api_url=None, attempt_base=0,
                                      metrics_path=str(tmp_path / "m")), world_size=WORLD)
    # each rank records its share; their mean (how the control plane combines ranks) is the job's loss
    got = [sum(s["losses"][k] for s in summaries) / WORLD for k in range(STEPS)]
    validated = JobSpec.model_validate(spec)
    want, want_eval = reference_losses(validated, "token")
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=0)
    for rank in range(WORLD):  # evaluation: the same token mean, the same on every rank
        last = json.loads((tmp_path / f"m.rank{rank}.jsonl").read_text().splitlines()[-1])
        assert last["eval_loss"] == pytest.approx(want_eval, rel=1e-4)
    wrong, _ = reference_losses(validated, "per_rank")
    assert not torch.allclose(torch.tensor(got), torch.tensor(wrong), rtol=1e-4, atol=0), (got, wrong)
    # the ranks' shares differ (different token counts): the weighting was exercised
    assert abs(summaries[0]["losses"][0] - summaries[1]["losses"][0]) > 1e-3


def test_step_loss_weights_micro_batches_by_their_tokens():
    logits = torch.randn(4, 3, 5)
    targets = torch.tensor([[1, 2, IGNORE_INDEX], [0, IGNORE_INDEX, IGNORE_INDEX],
                            [4, 4, 4], [IGNORE_INDEX, IGNORE_INDEX, 3]])
    micro = [(torch.zeros(2, 3), targets[:2]), (torch.zeros(2, 3), targets[2:])]
    step = StepLoss(micro, token_weighted=True, world_size=1, device=torch.device("cpu"))
    total = sum(step.micro_loss(logits[2 * m:2 * m + 2], t) for m, (_, t) in enumerate(micro))
    want = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(total, want)
    assert step.value() == pytest.approx(float(want))
    # an HF output's .logits is read the same way
    hf_like = type("Out", (), {"logits": logits})()
    assert torch.equal(logits_of(hf_like), logits)
    torch.testing.assert_close(token_loss_sum(hf_like, targets), want * 7)
    # a batch with every target masked trains on nothing rather than dividing by zero
    masked = torch.full((1, 3), IGNORE_INDEX)
    empty = StepLoss([(torch.zeros(1, 3), masked)], token_weighted=True, world_size=1, device=torch.device("cpu"))
    assert float(empty.micro_loss(logits[:1], masked)) == 0.0


def test_a_factory_models_own_mean_loss_is_averaged_over_micro_batches():
    micro = [(None, torch.zeros(1)), (None, torch.zeros(1))]
    step = StepLoss(micro, token_weighted=False, world_size=2, device=torch.device("cpu"))
    assert float(step.micro_loss(torch.tensor(2.0), micro[0][1])) == 1.0
    step.micro_loss(torch.tensor(4.0), micro[1][1])
    assert step.value() == 3.0


# ----------------------------------------------------------------------------- the data kinds


def run(spec: dict) -> list[float]:
    """The job's loss per step (the mean of the ranks' shares), 2 Gloo ranks."""
    summaries = run_local(LoopConfig(spec=spec, job_id="loss", api_url=None, attempt_base=0), world_size=WORLD)
    return [sum(s["losses"][k] for s in summaries) / WORLD for k in range(len(summaries[0]["losses"]))]


def test_sft_rows_of_different_lengths_train_like_one_process(tmp_path):
    """kind sft, a BPE tokenizer trained here: the prompt and padding are masked, rows differ in
    length, micro-batches of 2 below each rank's 4: the global token mean, as one process."""
    tokenizer = train_tokenizer(tmp_path / "tok")
    write_jsonl(tmp_path / "sft" / "rows.jsonl", [{"prompt": p, "completion": c} for p, c in PAIRS])
    spec = {**job(), "data": {"kind": "sft", "uri": (tmp_path / "sft").as_uri(), "format": "jsonl",
                              "seq_len": 24, "tokenizer": tokenizer.as_uri()}}
    del spec["eval"]
    got = run(spec)
    validated = JobSpec.model_validate(spec)
    want, _ = reference_losses(validated, "token")
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=0)
    wrong, _ = reference_losses(validated, "per_rank")
    assert not torch.allclose(torch.tensor(got), torch.tensor(wrong), rtol=1e-4, atol=0), (got, wrong)


def test_tokens_bin_and_parquet_start_with_the_loss_of_text_on_the_same_stream(tmp_path):
    """kind tokens (bin and parquet) holding the stream a text job tokenizes: the same first loss."""
    tokenizer = train_tokenizer(tmp_path / "tok")
    write_jsonl(tmp_path / "text" / "docs.jsonl", [{"text": d} for d in DOCUMENTS])
    text = {"kind": "text", "uri": (tmp_path / "text").as_uri(), "format": "jsonl", "seq_len": 8,
            "tokenizer": tokenizer.as_uri(), "shuffle": False}
    stream = build_dataset(DataSpec.model_validate(text)).stream.tokens
    (tmp_path / "bin").mkdir()
    stream.astype(np.uint16).tofile(tmp_path / "bin" / "train.bin")
    write_parquet(tmp_path / "parquet" / "train.parquet", {"input_ids": [stream[:50].tolist(), stream[50:].tolist()]})
    base = {**job(), "train": {**job()["train"], "steps": 1}}
    del base["eval"]
    losses = [run({**base, "data": data})[0] for data in (
        text,
        {"kind": "tokens", "uri": (tmp_path / "bin").as_uri(), "format": "bin", "seq_len": 8, "shuffle": False},
        {"kind": "tokens", "uri": (tmp_path / "parquet").as_uri(), "format": "parquet", "seq_len": 8,
         "shuffle": False})]
    assert losses[1] == losses[0] and losses[2] == losses[0], losses
