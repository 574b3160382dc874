"""Bad configuration fails early with a ValueError naming the field; the API refuses misuse."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from pydantic import ValidationError

from contract.spec import TrainSpec, ZeroSpec
from contract.zero_rules import allowed_stages
from workers.zero import ZeroConfig, ZeroEngine
from workers.zero import config as config_mod


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"stage": 7}, "stage"),
        ({"stage": -1}, "stage"),
        ({"stage": "2"}, "stage"),
        ({"stage": True}, "stage"),
        ({"bucket_mb": -1}, "bucket_mb"),
        ({"bucket_mb": 0}, "bucket_mb"),
        ({"bucket_mb": float("nan")}, "bucket_mb"),
        ({"precision": "fp8"}, "precision"),
        ({"precision": "bfloat16"}, "precision"),
        ({"prefetch": -1}, "prefetch"),
        ({"prefetch": 1.5}, "prefetch"),
        ({"grad_clip": 0}, "grad_clip"),
        ({"grad_clip": -1.0}, "grad_clip"),
        ({"grad_clip": float("inf")}, "grad_clip"),
        ({"overlap_comm": "yes"}, "overlap_comm"),
        ({"offload_optimizer": 1}, "offload_optimizer"),
        ({"initial_loss_scale": 0}, "initial_loss_scale"),
        ({"loss_scale_growth_interval": 0}, "loss_scale_growth_interval"),
        ({"wrap": 3}, "wrap"),
        ({"comm_timeout_s": 0}, "comm_timeout_s"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ZeroConfig(**{"stage": 2, **kwargs})


def test_good_values():
    cfg = ZeroConfig(stage=2, precision="bf16", bucket_mb=25, overlap_comm=True, offload_optimizer=False,
                     prefetch=1, grad_clip=None)
    assert cfg.compute_dtype == torch.bfloat16
    assert ZeroConfig.from_dict(cfg.to_dict()) == cfg
    ZeroConfig(stage=3, precision="bf16", wrap=["Block"], grad_clip=1, bucket_mb=0.5)
    with pytest.raises(ValueError, match="unknown ZeroConfig field"):
        ZeroConfig.from_dict({"stag": 1})


def test_fp16_on_a_cpu_that_cannot_is_a_value_error(monkeypatch):
    monkeypatch.setattr(config_mod, "dtype_usable", lambda dtype, device="cpu": dtype != torch.float16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="precision='fp16' is not supported"):
        ZeroConfig(stage=2, precision="fp16")
    ZeroConfig(stage=2, precision="bf16")


def test_the_probe_is_real():
    assert config_mod.dtype_usable(torch.float32)
    assert config_mod.dtype_usable(torch.bfloat16, "cpu")  # every CPU build torch 2.x ships


def _adamw(ps):
    return torch.optim.AdamW(ps, lr=1e-3)


def test_engine_refuses_misuse():
    with pytest.raises(ValueError, match="offload_optimizer needs stage 1, 2 or 3"):
        ZeroConfig(stage=0, offload_optimizer=True)
    model = nn.Linear(3, 3)
    with pytest.raises(TypeError, match="factory"):
        ZeroEngine(model, torch.optim.AdamW(model.parameters()), ZeroConfig(stage=1))
    with pytest.raises(ValueError, match="tensors it is given"):
        ZeroEngine(nn.Linear(3, 3), lambda ps: torch.optim.AdamW(model.parameters()), ZeroConfig(stage=1))
    with pytest.raises(TypeError, match="ZeroConfig"):
        ZeroEngine(nn.Linear(3, 3), _adamw, {"stage": 1})


def test_second_backward_after_sync_is_an_error():
    engine = ZeroEngine(nn.Linear(3, 2), _adamw, ZeroConfig(stage=0, precision="fp32"))
    x = torch.randn(4, 3)
    engine.backward(engine(x).sum(), sync=True)
    with pytest.raises(RuntimeError, match="sync=True"):
        engine.backward(engine(x).sum())
    engine.step()
    engine.backward(engine(x).sum())  # fine again after step()
    engine.step()


def test_precisions_are_the_contracts_with_the_element_sizes_it_states():
    from contract.zero_math import PRECISION_TRAITS

    assert tuple(config_mod.PRECISIONS) == tuple(PRECISION_TRAITS)
    for name, dtype in config_mod.PRECISIONS.items():
        assert torch.empty((), dtype=dtype).element_size() == PRECISION_TRAITS[name].element_bytes


def test_bucket_numel_is_bucket_mb_of_the_compute_dtype():
    assert ZeroConfig(stage=2, precision="fp32", bucket_mb=1).bucket_numel == 2**20 // 4
    assert config_mod.elements_per_bucket(1e-9, 4) == 1  # never an empty bucket


def test_the_job_facing_defaults_are_the_contracts():
    """One definition: a field ZeroSpec and ZeroConfig share has ZeroSpec's default on both sides."""
    spec, cfg = ZeroSpec(), ZeroConfig(stage=2)
    shared = set(ZeroSpec.model_fields) & set(ZeroConfig.__dataclass_fields__) - {"stage"}  # "auto" is a job's
    assert shared == set(ZeroSpec.model_fields) - {"stage"}
    assert {name: getattr(cfg, name) for name in shared} == {name: getattr(spec, name) for name in shared}
    assert cfg.precision == "fp32"


def test_the_engine_takes_no_stage_it_was_not_given():
    """The contract's default stage is "auto", which the engine cannot run: a caller names one,
    so no second default stage exists beside ZeroSpec's."""
    with pytest.raises(TypeError, match="stage"):
        ZeroConfig()
    with pytest.raises(TypeError):
        ZeroEngine(nn.Linear(3, 2), _adamw)


def test_from_spec_takes_every_field_of_the_block_and_the_jobs_grad_clip():
    zero = ZeroSpec(stage="auto", precision="bf16", bucket_mb=0.5, prefetch=2, activation_checkpointing=True,
                    reshard_after_forward="all_but_last", keep_gathered_bytes=1024, broadcast_buffers=False,
                    sync_batchnorm=True, shard_group_size=2)
    train = TrainSpec(steps=1, global_batch_size=2, micro_batch_size=1, grad_clip=0.5)
    cfg = ZeroConfig.from_spec(zero, train, stage=3, offload_optimizer=True)
    want = {**zero.model_dump(), "stage": 3, "offload_optimizer": True, "grad_clip": 0.5}
    assert {name: getattr(cfg, name) for name in want} == want
    with pytest.raises(ValueError, match="resolve it"):
        ZeroConfig.from_spec(zero, train)


def test_from_spec_takes_nvme_path_as_given():
    zero = ZeroSpec(stage=3, offload_optimizer="nvme", nvme_path="/mnt/nvme")
    train = TrainSpec(steps=1, global_batch_size=2, micro_batch_size=1)
    assert ZeroConfig.from_spec(zero, train).nvme_path == "/mnt/nvme"
    assert ZeroConfig.from_spec(zero, train, nvme_path="/mnt/nvme/job-1").nvme_path == "/mnt/nvme/job-1"


def test_offload_params_is_a_config_and_spec_field_the_engine_runs(tmp_path):
    """Submit admits it at stage 3; on a CPU rank "cpu" is where the shard already is, and "nvme"
    puts it in swap files (tests/workers/zero/test_nvme_offload.py has the runs)."""
    assert ZeroConfig(stage=3, offload_params="cpu").offload_params == "cpu"
    with pytest.raises(ValueError, match="offload_params must be None, 'cpu' or 'nvme'"):
        ZeroConfig(stage=3, offload_params="disk")
    assert ZeroSpec(stage=3, offload_params="nvme", nvme_path="/mnt/nvme").offload_params == "nvme"
    for place, path in (("cpu", None), ("nvme", str(tmp_path / "swap"))):
        engine = ZeroEngine(torch.nn.Linear(2, 2), lambda ps: torch.optim.SGD(ps, lr=0.1),
                            ZeroConfig(stage=3, offload_params=place, nvme_path=path))
        assert ("disk" in engine.memory()) == (place == "nvme")
        engine.close()
    assert not (tmp_path / "swap").exists()


@pytest.mark.parametrize("kwargs, message", [
    ({"stage": 0, "offload_optimizer": True}, "offload_optimizer needs stage 1, 2 or 3"),
    ({"stage": 2, "keep_gathered_bytes": 1}, "keep_gathered_bytes needs stage 3"),
    ({"stage": 2, "offload_params": "cpu"}, "offload_params needs stage 3"),
    ({"stage": 3, "offload_params": "nvme"}, "offload_params 'nvme' needs nvme_path"),
    ({"stage": 3, "nvme_path": "/x"}, "nvme_path is read with offload_optimizer or offload_params 'nvme', or with stage 'auto'"),
    ({"stage": 2, "quantized_weights": True}, r"quantized_weights \(ZeRO\+\+\) needs stage 3"),
    ({"stage": 0, "quantized_gradients": True}, r"quantized_gradients \(ZeRO\+\+\) needs stage 3"),
    ({"stage": 2, "hpz_partition_size": 2}, r"hpz_partition_size \(ZeRO\+\+'s hpZ\) needs stage 3"),
    ({"stage": 3, "hpz_partition_size": 3, "shard_group_size": 4}, r"hpz_partition_size \(3\) must divide "
                                                                    r"shard_group_size \(4\)"),
])
def test_the_cross_field_rules_are_the_contracts(kwargs, message):
    """The engine refuses with the sentence the control plane's 422 carries (contract/zero_rules.py)."""
    with pytest.raises(ValueError, match=message) as engine_refused:
        ZeroConfig(**kwargs)
    with pytest.raises(ValidationError) as submit_refused:
        ZeroSpec(**kwargs)
    assert str(engine_refused.value) in str(submit_refused.value)


def test_zeropp_fields_default_off_and_come_from_the_spec():
    cfg = ZeroConfig(stage=3)
    assert (cfg.quantized_weights, cfg.quantized_gradients, cfg.hpz_partition_size) == (False, False, None)
    zero = ZeroSpec(stage=3, quantized_weights=True, quantized_gradients=True)
    train = TrainSpec(steps=1, global_batch_size=2, micro_batch_size=1)
    got = ZeroConfig.from_spec(zero, train)
    assert (got.quantized_weights, got.quantized_gradients) == (True, True)
    with pytest.raises(ValueError, match="quantized_weights must be True or False"):
        ZeroConfig(stage=3, quantized_weights=1)


def test_hpz_partition_size_is_taken_at_stage_3_and_checked():
    assert ZeroConfig(stage=3, hpz_partition_size=2).hpz_partition_size == 2
    assert ZeroConfig(stage=3, hpz_partition_size=2, shard_group_size=4).hpz_partition_size == 2
    zero = ZeroSpec(stage=3, hpz_partition_size=2)
    got = ZeroConfig.from_spec(zero, TrainSpec(steps=1, global_batch_size=2, micro_batch_size=1))
    assert got.hpz_partition_size == 2
    for bad in (0, True, 1.5, "2"):
        with pytest.raises(ValueError, match="hpz_partition_size must be None"):
            ZeroConfig(stage=3, hpz_partition_size=bad)
    assert allowed_stages(False, 0, offload_params=None, quantized_weights=False, quantized_gradients=False,
                          hpz_partition_size=2) == (3,)
    assert ZeroSpec(stage="auto", hpz_partition_size=2).hpz_partition_size == 2  # "auto" picks stage 3


def test_offload_params_leaves_auto_only_stage_3():
    assert allowed_stages(False, 0, offload_params="nvme", quantized_weights=False,
                          quantized_gradients=False) == (3,)
    assert allowed_stages(True, 0, offload_params=None, quantized_weights=False,
                          quantized_gradients=False) == (1, 2, 3)
    for name in ("quantized_weights", "quantized_gradients"):  # ZeRO++ is stage 3's
        assert allowed_stages(False, 0, offload_params=None, **{"quantized_weights": False,
                                                                "quantized_gradients": False, name: True}) == (3,)
