"""Issue 31: a job's ``model.hf`` is built by the worker and trained by the engine on 2 Gloo ranks.

* without ``init_from``: every rank ends with the same random init, and one process reproduces it
  (build on meta, initialize the modules in another order with ``init_weights_for``);
* with ``init_from``: the HF safetensors load by HF names, a tied weight stored once (as
  ``save_pretrained`` writes it) or twice, and the logits equal the source model's;
* must show 5: ``/plan``'s planner (``plan_for_spec``, shape from config.json alone) and
  ``stage: "auto"`` predict the model-state bytes ``engine.memory()`` holds after a step (±1%
  plus the padding's bytes), at stages 0-3.
"""

from __future__ import annotations

import pytest

from . import tiny

pytest.importorskip("transformers")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from contract.spec import JobSpec  # noqa: E402
from contract.zero_math import low_precision_bytes, optimizer_bytes_per_param  # noqa: E402
from workers.zero.testing import spawn_world  # noqa: E402

SEQ, MICRO, WORLD = 16, 2, 2
STAGES = (0, 1, 2, 3)


def job(uri: str, init_from: str | None = None, stage=3, precision: str = "fp32") -> JobSpec:
    model = {"hf": uri} | ({"init_from": init_from} if init_from else {})
    return JobSpec.model_validate({
        "name": "hf", "model": model, "data": {"kind": "synthetic", "seq_len": SEQ, "vocab_size": 96},
        "train": {"steps": 1, "global_batch_size": MICRO * WORLD, "micro_batch_size": MICRO, "seed": 7},
        "zero": {"stage": stage, "precision": precision, "bucket_mb": 0.01}, "resources": {"num_workers": WORLD}})


def _one_step(engine, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 96, (MICRO, SEQ), generator=g)
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    return loss.detach()


def rank_run(rank: int, world_size: int, cases: list[tuple[str, str | None, int]]) -> list[dict]:
    from workers.train import build_engine, build_job_model

    out = []
    for uri, init_from, stage in cases:
        spec = job(uri, init_from, stage)
        torch.manual_seed(100 + rank)  # the global RNG differs per rank: the init must not depend on it
        model, init = build_job_model(spec, resuming=False)
        engine = build_engine(spec, model, torch.device("cpu"), init)
        start = {k: v.clone() for k, v in engine.full_state_dict().items()}
        x = torch.arange(2 * SEQ).view(2, SEQ) % 96
        model.eval()  # gpt2's dropout
        with torch.no_grad():
            logits = engine(input_ids=x).logits.clone()
        model.train()
        _one_step(engine, rank)
        out.append({"start": start, "logits": logits, "memory": engine.memory(), "stage": stage})
        engine.remove_hooks()
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    made = {}
    for name in ("llama-tied", "gpt2-untied-inner"):
        made[name] = tiny.save(name, str(root / name), seed=3)
    twice = root / "llama-tied-twice"  # the tied weight under both names, as some exporters write it
    twice.mkdir()
    state = load_file(str(root / "llama-tied" / "model.safetensors"))
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(twice / "model.safetensors"))
    return root, made


@pytest.fixture(scope="module")
def runs(dirs):
    root = dirs[0]
    uri = f"file://{root}/llama-tied"
    cases = [(uri, None, 3), (uri, uri, 3), (uri, f"file://{root}/llama-tied-twice", 1),
             (f"file://{root}/gpt2-untied-inner", f"file://{root}/gpt2-untied-inner", 3)]
    cases += [(uri, uri, s) for s in (0, 2)]
    per_rank = spawn_world(rank_run, world_size=WORLD, args=(cases,), timeout_s=300)
    return cases, per_rank


def test_random_init_is_one_model_on_every_rank_and_one_process_reproduces_it(dirs, runs):
    from workers.hf_models import build_hf_model, init_weights_for
    from workers.zero.materialize import _swap

    (uri, _, _), per_rank = runs[0][0], runs[1]
    r0, r1 = per_rank[0][0]["start"], per_rank[1][0]["start"]
    assert all(torch.equal(r0[k], r1[k]) for k in r0)
    model = build_hf_model(uri)
    init = init_weights_for(model, job(uri).train.seed)
    for module in reversed(list(model.modules())):  # another order than the engine's
        for name, p in module._parameters.items():
            if p is not None and p.is_meta:
                _swap(p, torch.empty(p.shape))
        init(module)
    mine = model.state_dict()
    assert set(mine) == set(r0)
    assert all(torch.equal(mine[k], r0[k]) for k in mine)
    assert 0.015 < r0["model.layers.0.mlp.up_proj.weight"].std() < 0.025  # the family's own scheme (0.02)
    assert torch.equal(r0["model.norm.weight"], torch.ones(32))


@pytest.mark.parametrize("case", [1, 2, 3])
def test_init_from_loads_hf_names_tied_once_or_twice(dirs, runs, case):
    made = dirs[1]
    per_rank = runs[1]
    name = "gpt2-untied-inner" if case == 3 else "llama-tied"
    ref = made[name]
    expected = ref.state_dict()
    for rank in range(WORLD):
        got = per_rank[rank][case]
        assert set(got["start"]) == set(expected)
        assert all(torch.equal(got["start"][k], expected[k]) for k in expected)
        x = torch.arange(2 * SEQ).view(2, SEQ) % 96
        with torch.no_grad():
            torch.testing.assert_close(got["logits"], ref(input_ids=x).logits, rtol=1e-5, atol=1e-5)


def test_plan_and_auto_predict_the_engines_model_state_bytes(dirs, runs):
    """Must show 5: the planner reads only config.json (``contract.hf_config``) and predicts what
    ``engine.memory()`` holds after a step, at every stage, within 1% plus the padding."""
    from workers.planning import plan_for_spec

    cases, per_rank = runs
    measured_at = {c[2]: per_rank[0][i]["memory"] for i, c in enumerate(cases) if c[1] and "llama" in c[0]}
    uri = cases[0][0]
    assert sorted(measured_at) == list(STAGES)
    per_elem = 2 * low_precision_bytes("fp32") + optimizer_bytes_per_param("fp32")
    for stage, measured in sorted(measured_at.items()):
        pred = plan_for_spec(job(uri, uri, stage)).chosen
        states_pred = pred.gpu["params"] + pred.gpu["optimizer"]
        states_meas = measured["params"] + measured["grads"] + measured["optimizer"]
        allowed = 0.01 * states_meas + pred.padding_bytes // low_precision_bytes("fp32") * per_elem
        print(f"stage {stage}: predicted {states_pred} measured {states_meas} "
              f"({(states_pred - states_meas) / states_meas:+.3%})")
        assert abs(states_pred - states_meas) <= allowed, (stage, states_pred, states_meas)
    auto = plan_for_spec(job(uri, uri, "auto"), host_memory_bytes=1 << 40)
    chosen = auto.chosen
    measured = measured_at[auto.stage]
    states_meas = measured["params"] + measured["grads"] + measured["optimizer"]
    states_pred = chosen.gpu["params"] + chosen.gpu["optimizer"]
    assert abs(states_pred - states_meas) <= 0.01 * states_meas + chosen.padding_bytes // 4 * per_elem


def test_planner_reads_config_json_alone(dirs, monkeypatch):
    """No transformers model is built for the shape: the planner's shape is the arithmetic's."""
    import workers.zero.planner.shape as shape
    from workers.planning import job_shape

    root = dirs[0]
    uri = f"file://{root}/llama-tied"
    monkeypatch.setattr(shape, "build_on_meta", lambda *a: pytest.fail("built the model to plan it"))
    got = job_shape(job(uri).model)
    assert got.phi == sum(p.numel() for p in dirs[1]["llama-tied"].parameters())


def test_an_hf_models_real_buffers_go_to_the_workers_device(dirs, monkeypatch):
    """The rotary tables are built for real on the CPU; a GPU worker's engine computes where a meta
    model's first real tensor is, so build_engine moves them to the worker's device first (shown
    with the meta device as the target: any device other than the CPU the buffers were built on)."""
    import workers.train as train

    uri = f"file://{dirs[0]}/llama-tied"
    seen = {}
    monkeypatch.setattr(train, "ZeroEngine", lambda model, **kw: seen.setdefault("model", model))
    model, init = train.build_job_model(job(uri), resuming=False)
    assert {b.device.type for b in model.buffers()} == {"cpu"}
    train.build_engine(job(uri), model, torch.device("meta"), init)
    assert {b.device.type for b in seen["model"].buffers()} == {"meta"}
