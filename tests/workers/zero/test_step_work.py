"""``planner.step_work``: a step's non-matmul work, counted on meta, that the time model prices."""

from __future__ import annotations

import torch

from workers.zero.planner.step_work import StepWork, WorkCounter, count_step_work, is_matmul


def test_element_wise_operations_count_their_bytes_views_and_matmuls_only_their_dispatch():
    a, b = torch.ones(1000, device="meta"), torch.ones(1000, device="meta")
    m = torch.ones(10, 20, device="meta")
    with WorkCounter() as counter:
        c = a + b  # reads two, writes one: 3 × 4,000 bytes
    assert (counter.ops, counter.elementwise_bytes) == (1, 12_000)
    with WorkCounter() as counter:
        c.add_(a)  # in place: c and a read, c written
        c.view(10, 100)  # a view moves nothing
        torch.mm(m, m.t())  # priced by its flops
    assert counter.work == StepWork(elementwise_bytes=12_000, ops=4)  # add_, view, t, mm


def test_matmul_and_attention_kernels_are_priced_by_flops():
    assert is_matmul("mm") and is_matmul("addmm") and is_matmul("bmm")
    assert is_matmul("_scaled_dot_product_flash_attention_for_cpu_backward")
    assert not is_matmul("gelu") and not is_matmul("native_layer_norm")


def test_a_models_work_grows_with_its_tokens_and_shrinks_with_its_precision():
    one = count_step_work({"preset": "gpt-nano"}, 1, 64, "fp32")
    two = count_step_work({"preset": "gpt-nano"}, 2, 64, "fp32")
    assert one.ops == two.ops > 100  # the same operations, on twice the tokens
    assert 1.5 * one.elementwise_bytes < two.elementwise_bytes  # activations double; the embedding's gradient does not
    assert count_step_work({"preset": "gpt-nano"}, 2, 64, "bf16").elementwise_bytes < two.elementwise_bytes
    assert two.times(3) == StepWork(3 * two.elementwise_bytes, 3 * two.ops)
