"""Issue 33: a DeepSpeed config read as zerotrain's spec fields (``contract.deepspeed``).

The examples are DeepSpeed's own (docs.deepspeed.ai: the config JSON reference and the ZeRO
tutorials); each becomes exactly the fields a user would write by hand. Wrong configs are each
a ``DeepSpeedConfigError`` naming the ``deepspeed.<path>`` and why.
"""

from __future__ import annotations

import pytest

from contract.deepspeed import DeepSpeedConfigError, apply, translate
from contract.spec import JobSpec

SPEC = {"name": "ds", "model": {"preset": "gpt-nano"}, "data": {"kind": "synthetic", "seq_len": 64},
        "train": {"steps": 100, "global_batch_size": 16, "micro_batch_size": 2},
        "resources": {"num_workers": 2}}

ZERO2_CPU_OFFLOAD = {  # "ZeRO-Offload" tutorial
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "contiguous_gradients": True,
                          "overlap_comm": True}}
ZERO3_NVME_BOTH = {  # "ZeRO-Infinity": the optimizer and the parameters on NVMe
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"},
                          "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 5}}}
ZERO3_NVME_OPTIMIZER = {  # "ZeRO-Infinity": the optimizer on NVMe
    "zero_optimization": {"stage": 3, "contiguous_gradients": True, "stage3_max_live_parameters": 1e9,
                          "stage3_max_reuse_distance": 1e9, "stage3_prefetch_bucket_size": 1e7,
                          "stage3_param_persistence_threshold": 1e5, "reduce_bucket_size": 1e7,
                          "sub_group_size": 1e9,
                          "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True}}}
BF16 = {"bf16": {"enabled": True}}
WARMUP_LR = {  # the config reference's optimizer and scheduler examples
    "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                 "warmup_num_steps": 1000}}}
HF_TRAINER_AUTO = {  # what HF Trainer's documented ZeRO-2 config looks like: "auto" everywhere
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto"}


@pytest.mark.parametrize("ds, by_hand, ignored", [
    (ZERO2_CPU_OFFLOAD, {"zero": {"stage": 2, "offload_optimizer": "cpu"}}, 2),
    (ZERO3_NVME_OPTIMIZER, {"zero": {"stage": 3, "offload_optimizer": "nvme", "nvme_path": "/local_nvme"}}, 8),
    (ZERO3_NVME_BOTH, {"zero": {"stage": 3, "offload_optimizer": "nvme", "nvme_path": "/local_nvme",
                                "offload_params": "nvme"}}, 1),
    (BF16, {"zero": {"precision": "bf16"}}, 0),
    (WARMUP_LR, {"train": {"optimizer": "adamw", "lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                           "weight_decay": 3e-7, "warmup_steps": 1000, "warmup_type": "log",
                           "schedule": "constant"}}, 0),
    (HF_TRAINER_AUTO, {"train": {"optimizer": "adamw"}, "zero": {"stage": 2, "offload_optimizer": "cpu"}}, 7),
])
def test_deepspeeds_own_examples_become_the_fields_written_by_hand(ds, by_hand, ignored):
    translation = translate(ds, SPEC)
    assert translation.fields == by_hand
    assert len([n for n in translation.notes if n.startswith("ignored: deepspeed.")]) == ignored, translation.notes
    spec, _ = apply({**SPEC, "deepspeed": ds})
    assert "deepspeed" not in spec
    for section, values in by_hand.items():
        assert {k: spec[section][k] for k in values} == values


def test_batch_sizes_and_accumulation_check_each_other_against_the_workers():
    assert translate({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
                     {**SPEC, "train": {"steps": 100}}).fields == \
        {"train": {"global_batch_size": 16, "micro_batch_size": 4}}  # 4 x 2 x 2 workers
    with pytest.raises(DeepSpeedConfigError) as error:
        translate({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
                  {**SPEC, "train": {"steps": 1}})
    assert error.value.path == "deepspeed.gradient_accumulation_steps" and "2 workers" in error.value.message


def test_zeropp_keys_become_the_zero_fields():
    got = translate({"zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                                           "zero_quantized_gradients": True, "zero_hpz_partition_size": 1}}, SPEC)
    assert got.fields["zero"] == {"stage": 3, "quantized_weights": True, "quantized_gradients": True}
    hpz = translate({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}}, SPEC)
    assert hpz.fields["zero"]["hpz_partition_size"] == 8
    fields, _ = apply({**SPEC, "deepspeed": {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}})
    assert JobSpec(**fields).zero.hpz_partition_size == 2  # hpZ is built: a job on 2 workers takes it


def test_schedulers_map_onto_warmup_schedule_and_floor():
    decay = translate({"scheduler": {"type": "WarmupDecayLR", "params": {
        "total_num_steps": 100, "warmup_max_lr": 3e-4, "warmup_num_steps": 10, "warmup_type": "linear"}}}, SPEC)
    assert decay.fields["train"] == {"warmup_steps": 10, "warmup_type": "linear", "lr": 3e-4,
                                     "schedule": "linear", "min_lr_ratio": 0.0}
    cosine = translate({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100,
                                                                          "warmup_num_steps": 5}}}, SPEC)
    assert cosine.fields["train"] == {"warmup_steps": 5, "warmup_type": "log", "schedule": "cosine",
                                      "min_lr_ratio": 0.0001}


WRONG = [
    ({"zero_optimization": {"stage": 4}}, "deepspeed.zero_optimization.stage", "0, 1, 2 or 3"),
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/x"},
                            "offload_param": {"device": "nvme", "nvme_path": "/y"}}},
     "deepspeed.zero_optimization.offload_param.nvme_path", "one folder"),
    ({"zero_optimization": {"mics_shard_size": 4}}, "deepspeed.zero_optimization.mics_shard_size", "MiCS"),
    ({"zero_optimization": {"zero_quantized_weights": "yes"}}, "deepspeed.zero_optimization.zero_quantized_weights",
     "true or false"),
    ({"fp16": {"enabled": True, "loss_scale": 128}}, "deepspeed.fp16.loss_scale", "static loss scale"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "deepspeed.fp16.enabled", "both"),
    ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, "deepspeed.optimizer.type", "Adam, AdamW or SGD"),
    ({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "amsgrad": True}}}, "deepspeed.optimizer.params.amsgrad",
     "AMSGrad"),
    ({"scheduler": {"type": "OneCycle", "params": {}}}, "deepspeed.scheduler.type", "WarmupLR"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 5000}}},
     "deepspeed.scheduler.params.total_num_steps", "train.steps (100)"),
    ({"gradient_clipping": "one"}, "deepspeed.gradient_clipping", "finite number"),
    ({"train_micro_batch_size_per_gpu": 8}, "deepspeed.train_micro_batch_size_per_gpu", "the spec sets it to 2"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "disk"}}},
     "deepspeed.zero_optimization.offload_optimizer.device", "none, cpu, nvme"),
    ({"amp": {"enabled": True}}, "deepspeed.amp", "not a DeepSpeed key zerotrain reads"),
    ({"activation_checkpointing": {"cpu_checkpointing": True}}, "deepspeed.activation_checkpointing.cpu_checkpointing",
     "not built"),
    ("not an object", "deepspeed", "must be an object"),
]


@pytest.mark.parametrize("ds, path, words", WRONG)
def test_a_wrong_config_names_its_path_and_why(ds, path, words):
    with pytest.raises(DeepSpeedConfigError) as error:
        translate(ds, SPEC)
    assert error.value.path == path and words in error.value.message, str(error.value)
