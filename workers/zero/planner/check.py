"""Checking a prediction after the fact: the process's peak, part by part, and every term's error.

A prediction nobody checks drifts. The worker measures with ``PeakMemoryMeter`` while it
trains and, at the end, ``compare`` gives the per-term error against what was predicted; the
control plane stores it on the job (``service/api/memory_check.py``). What "peak" means is the
contract's (``contract.metrics``, the note on a rank's peak memory).
"""

from __future__ import annotations

from typing import Any

import torch

from contract.metrics import PEAK_PARTS, peak_part_key


class PeakMemoryMeter:
    """Peak memory growth of this process since ``start()``, over the whole job and per part.

    CUDA: ``max_memory_allocated`` above the allocation at ``start()``. CPU (Linux): the
    kernel's peak resident set (VmHWM) above the RSS at ``start()``; a CPU rank maps large
    blocks fresh (``workers/host_memory.py``) so that this peak means what the CUDA one means.
    Call ``start()`` before building the model, then ``lap(part)`` whenever a part of the job
    ends (``contract.metrics.PEAK_PARTS``): the peak since the previous lap is that part's (the
    largest over its repetitions), and the high-water mark starts again from what is held now.
    ``peak_growth()`` is the job's peak so far: the largest of every part and the current one.
    """

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.baseline = 0
        self.parts: dict[str, int] = {}
        self._peak = 0

    def start(self) -> None:
        if self.device.type != "cuda":  # free pages malloc kept would be reused without growing the RSS
            from workers.host_memory import release_free_memory

            release_free_memory()
        self.baseline = self._current()
        self.parts, self._peak = {}, 0
        self.reset_peak()

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")

    def lap(self, part: str) -> int:
        """End of ``part`` (one of ``PEAK_PARTS``): record the peak since the last lap under it."""
        if part not in PEAK_PARTS:
            raise ValueError(f"no such part of a job: {part!r}; the parts are {list(PEAK_PARTS)}")
        grown = self._since_lap()
        self.parts[part] = max(self.parts.get(part, 0), grown)
        self._peak = max(self._peak, grown)
        self.reset_peak()
        return grown

    def since_lap(self) -> int:
        """The peak growth since the last ``lap`` (or ``start``): the part running now."""
        return self._since_lap()

    def peak_growth(self) -> int:
        return max(self._peak, self._since_lap())

    def report(self) -> dict[str, int]:
        """``peak`` and ``peak_<part>`` for every part measured: the memory report's keys."""
        return {"peak": self.peak_growth(), **{peak_part_key(p): v for p, v in self.parts.items()}}

    def _since_lap(self) -> int:
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


def predicted_peak(candidate: dict[str, Any]) -> dict[str, Any]:
    """A stored candidate's peak (``peak.summarize``). A prediction stored before the planner
    predicted parts has only ``gpu.total``: its peak is that (+ the host on a CPU rank), unsplit."""
    if candidate.get("peak"):
        return candidate["peak"]
    host = (candidate.get("cpu") or {}).get("total", 0) if candidate.get("device") == "cpu" else 0
    return {"bytes": candidate["gpu"]["total"] + host, "parts": {}}


def compare(prediction: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """Per-term error of a prediction against measurements (pure; the worker calls it at the end).

    ``prediction``: a ``Plan.to_dict()`` (its ``chosen`` entry is used) or one candidate's
    dict. ``measured``: ``engine.memory()`` keys (params, grads, optimizer, buffers, total;
    ``host`` under offload) and optionally ``peak`` and ``peak_<part>`` (``PeakMemoryMeter.report``).
    Each term: predicted, measured, error_bytes (predicted − measured), rel_error (/ measured).
    Buffers compare with the buffer scratch + gathered units (the engine frees its scratch after
    each step, so a measurement taken between steps sees only module buffers); ``total`` with
    the model-state + buffer terms; ``peak`` with the predicted peak (the worst part), and each
    ``peak_<part>`` with that part's prediction.
    """
    chosen = prediction.get("chosen") or prediction
    gpu = chosen["gpu"]
    predicted = {
        "params": gpu["params"],
        "grads": gpu["grads"],
        "optimizer": gpu["optimizer"],
        "buffers": gpu["buffers"] + gpu["gathered_units"],
    }
    predicted["total"] = sum(predicted.values())
    if chosen.get("offload"):
        predicted["host"] = (chosen.get("cpu") or {}).get("total", 0)
    peak = predicted_peak(chosen)
    predicted["peak"] = peak["bytes"]
    for part, value in peak.get("parts", {}).items():
        predicted[peak_part_key(part)] = value
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
