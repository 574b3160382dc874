"""Checking a prediction after the fact: the process's peak, and the error of every term.

A prediction nobody checks drifts. The worker measures with ``PeakMemoryMeter`` while it
trains and, at the end, ``compare`` gives the per-term error against what was predicted; the
control plane stores it on the job (``service/api/memory_check.py``).
"""

from __future__ import annotations

from typing import Any

import torch


class PeakMemoryMeter:
    """Peak memory growth of this process since ``start()``: what ``compare`` calls "peak".

    CUDA: ``max_memory_allocated`` above the allocation at ``start()``. CPU (Linux): the
    kernel's peak resident set (VmHWM) above the RSS at ``start()``. glibc keeps freed memory
    unless large blocks are mmapped, so start CPU workers with ``MALLOC_MMAP_THRESHOLD_=65536``
    for a peak that means what the CUDA one means. Call ``start()`` before building the model
    and ``reset_peak()`` after building the engine (construction transients are not training).
    """

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.baseline = 0

    def start(self) -> None:
        self.baseline = self._current()
        self.reset_peak()

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")

    def peak_growth(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        return _proc_status_bytes("VmHWM") - self.baseline

    def _current(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return _proc_status_bytes("VmRSS")


def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def compare(prediction: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """Per-term error of a prediction against measurements (pure; the worker calls it at the end).

    ``prediction``: a ``Plan.to_dict()`` (its ``chosen`` entry is used) or one candidate's
    dict. ``measured``: ``engine.memory()`` keys (params, grads, optimizer, buffers, total;
    ``host`` under offload) and optionally ``peak`` (peak bytes growth of the process: CUDA
    max allocated, or RSS on CPU). Each term: predicted, measured, error_bytes (predicted −
    measured), rel_error (/ measured). Buffers compare with the buffer scratch + gathered
    units (the engine frees its scratch after each step, so a measurement taken between steps
    sees only module buffers); ``total`` with the model-state + buffer terms; ``peak`` with
    the full predicted total (activations and reserve included).
    """
    gpu = (prediction.get("chosen") or prediction)["gpu"]
    predicted = {
        "params": gpu["params"],
        "grads": gpu["grads"],
        "optimizer": gpu["optimizer"],
        "buffers": gpu["buffers"] + gpu["gathered_units"],
    }
    predicted["total"] = sum(predicted.values())
    chosen = prediction.get("chosen") or prediction
    host = (chosen.get("cpu") or {}).get("total", 0)
    if chosen.get("offload"):
        predicted["host"] = host
    # on a CPU-only machine the "host" terms live in the same memory the peak measures
    predicted["peak"] = gpu["total"] + (host if chosen.get("device") == "cpu" else 0)
    out = {}
    for term, value in predicted.items():
        if measured.get(term) is None:
            continue
        actual = float(measured[term])
        out[term] = {
            "predicted": value,
            "measured": actual,
            "error_bytes": value - actual,
            "rel_error": (value - actual) / actual if actual else None,
        }
    return out
