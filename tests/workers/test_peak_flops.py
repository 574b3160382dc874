"""The MFU denominator: dense peaks per exact device model and per matmul precision."""

from __future__ import annotations

import pytest

from workers.peak_flops import PEAK_FLOPS, matmul_precision, model_key, peak_for, peak_flops


@pytest.mark.parametrize("name,key", [
    ("NVIDIA L4", ("L4",)), ("NVIDIA L40", ("L40",)), ("NVIDIA L40S", ("L40S",)),
    ("NVIDIA H20", ("H20",)), ("NVIDIA H200", ("H200",)), ("NVIDIA H200 NVL", ("H200", "NVL")),
    ("NVIDIA H100 80GB HBM3", ("H100",)), ("NVIDIA H100 PCIe", ("H100", "PCIE")), ("NVIDIA H100 NVL", ("H100", "NVL")),
    ("NVIDIA GH200 480GB", ("GH200",)), ("NVIDIA A100-SXM4-80GB", ("A100",)), ("NVIDIA A100 80GB PCIe", ("A100",)),
    ("NVIDIA A10G", ("A10G",)), ("NVIDIA A10", ("A10",)), ("NVIDIA GeForce RTX 4090", ("RTX", "4090")),
    ("Tesla V100-SXM2-16GB", ("V100",)), ("Tesla V100-PCIE-32GB", ("V100", "PCIE")), ("Tesla V100S-PCIE-32GB", ("V100S",)),
    ("Tesla T4", ("T4",)), ("AMD Instinct MI300X", ("MI300X",)),
    ("NVIDIA RTX A6000", None), ("NVIDIA L4000", None), ("", None),
])
def test_a_name_matches_only_its_exact_model(name, key):
    assert model_key(name) == key


def test_l4_is_not_an_l40_and_h20_is_not_an_h200():
    assert peak_for("NVIDIA L4", "bf16") == 121e12 and peak_for("NVIDIA L40", "bf16") == 181e12
    assert peak_for("NVIDIA H20", "bf16") == 148e12 and peak_for("NVIDIA H200", "bf16") == 989.5e12


def test_each_precision_has_its_own_peak():
    h100 = [peak_for("NVIDIA H100 80GB HBM3", p) for p in ("fp32", "tf32", "bf16", "fp16")]
    assert h100 == [67e12, 494.5e12, 989.5e12, 989.5e12]
    assert peak_for("NVIDIA A100-SXM4-40GB", "fp32") == 19.5e12  # an fp32 run is not measured against bf16's 312


def test_no_bf16_or_tf32_peak_where_the_hardware_has_none():
    for name in ("Tesla V100-SXM2-16GB", "Tesla T4"):
        assert peak_for(name, "bf16") is None and peak_for(name, "tf32") is None
        assert peak_for(name, "fp16") > peak_for(name, "fp32") > 0
    assert all(set(p) <= {"fp32", "tf32", "bf16", "fp16"} and "fp32" in p for p in PEAK_FLOPS.values())


def test_the_precision_a_run_uses():
    assert matmul_precision("bf16") == "bf16" and matmul_precision("fp16") == "fp16"
    assert matmul_precision("fp32", allow_tf32=False) == "fp32"
    assert matmul_precision("fp32", allow_tf32=True) == "tf32"
    with pytest.raises(ValueError, match="precision must be fp32, bf16 or fp16"):
        matmul_precision("int8")
    with pytest.raises(ValueError, match="matmul precision must be one of"):
        peak_for("NVIDIA H100 PCIe", "fp8")


def test_no_peak_on_a_cpu():
    assert peak_flops("cpu", "fp32") is None
