"""The predicted model-state bytes per rank that the job page draws beside the measured bars.

The ZeRO formula by arithmetic (``contract.zero_math``, torch-free), for jobs whose Φ is known
without building the model: the built-in presets (``contract.presets`` computes their Φ from
the shape). The stage is the spec's, or — when the spec says "auto" — the one the job's
checkpoints were written at. Jobs with a user factory get no prediction until the planner
stores one on the job.
"""

from __future__ import annotations

from typing import Any

from contract import zero_math
from contract.metrics import PEAK_PARTS, peak_part_key
from contract.presets import PRESETS
from contract.spec import JobSpec
from service.models import typed_spec


def model_state_bytes(phi: int, world: int, stage: int, precision: str,
                      optimizer_states: int = zero_math.ADAM_STATE_TENSORS) -> dict[str, int]:
    """Params / grads / optimizer bytes on one rank (padding aside), as the job page draws them."""
    states = zero_math.model_state_bytes(phi, world, precision, stage, optimizer_states=optimizer_states)
    return {"params": states.gpu_params, "grads": states.gpu_grads, "optimizer": states.gpu_optimizer,
            "total": states.gpu_total}


def comm_elements_per_step(phi: int, stage: int, reshard_after_forward: bool) -> int:
    """Elements one rank communicates per micro-step: 2Φ for stages 0–2, 3Φ for stage 3 (2Φ when
    it keeps the units gathered into the backward)."""
    return zero_math.comm_elements(phi, stage, reshard_after_forward)


def planned_comm_bytes_per_step(chosen: dict[str, Any]) -> int | None:
    """The planner's bytes per rank and optimizer step, as the job's ``comm_bytes`` metric counts
    them: its count by group (padding, every micro-step and ZeRO++'s quantized bytes included; 0
    on one rank). A prediction stored before that count existed has only one micro-step's
    ``comm_bytes``; older ones have neither."""
    if "comm_bytes_by_group" in chosen:
        return sum(sum(kinds.values()) for kinds in (chosen["comm_bytes_by_group"] or {}).values())
    return chosen.get("comm_bytes")


def from_planner(planner: dict[str, Any], memory_check: dict[str, Any] | None) -> dict[str, Any]:
    """The planner's stored prediction (``Job.prediction``) in the shape the job page draws.

    Its chosen candidate's model-state terms (padding included) become the marker. The predicted
    peak per rank rides along for the memory note: its worst part and every part in plain words
    (``contract.metrics.PEAK_PARTS``), each beside rank 0's measurement once the job has ended; so
    does rank 0's predicted-vs-measured error per term. ``peak_total`` is what the budget was
    checked against: the peak plus the allocator's reserve. A prediction stored before the planner
    split the peak into parts has no ``peak``: its ``peak_total`` stands alone.
    """
    chosen = planner["chosen"]
    gpu = chosen["gpu"]
    terms = {k: gpu[k] for k in ("params", "grads", "optimizer")}
    check = ((memory_check or {}).get("ranks") or {}).get("0", {}).get("terms") or {}
    peak = chosen.get("peak") or {}
    parts = [{"part": part, "words": PEAK_PARTS.get(part, part), "predicted": value,
              "measured": (check.get(peak_part_key(part)) or {}).get("measured"),
              "rel_error": (check.get(peak_part_key(part)) or {}).get("rel_error")}
             for part, value in (peak.get("parts") or {}).items()]
    whole = {term: value.get("rel_error") for term, value in check.items() if not term.startswith("peak_")}
    return {
        "source": "planner",
        "stage": chosen["stage"],
        "offload": chosen["offload"],
        "offload_params": chosen.get("offload_params"),
        "world": chosen["n_ranks"],
        "precision": chosen["precision"],
        **terms,
        "total": sum(terms.values()),
        "peak_total": gpu["total"],
        "peak": peak.get("bytes"),
        "peak_where": PEAK_PARTS.get(peak.get("part"), peak.get("part")),
        "peak_measured": (check.get("peak") or {}).get("measured"),
        "peak_parts": parts or None,
        "comm_elements_per_step": chosen["comm_elements"],
        "comm_bytes_per_step": planned_comm_bytes_per_step(chosen),
        "choice": planner.get("reason"),
        "check": whole or None,
    }


def predict(spec: JobSpec | None, checkpoint_stage: int | None, planner: dict[str, Any] | None = None,
            memory_check: dict[str, Any] | None = None) -> dict[str, Any]:
    """The prediction for a job (the planner's when stored), or ``{"reason": ...}`` saying why there is none.

    ``spec`` is the job's stored spec, typed (``stored_spec``); None for a row that no longer
    validates, which gets a reason instead of breaking the page.
    """
    if planner and planner.get("chosen"):
        return from_planner(planner, memory_check)
    if spec is None:
        return {"reason": "the job's stored spec does not validate under this version of the service"}
    preset = PRESETS.get(spec.model.preset or "")
    stage = spec.zero.stage if isinstance(spec.zero.stage, int) else checkpoint_stage
    if preset is None:
        return {"reason": "the model is a Hugging Face model or a user factory: its size is known once the planner "
                          "stores a prediction"}
    if stage is None:
        return {"reason": "the stage is 'auto' and not resolved yet (no checkpoint records it)"}
    phi, world, precision = preset.parameters, spec.resources.num_workers, spec.zero.precision
    return {
        "source": "formula",
        "phi": phi,
        "stage": stage,
        "world": world,
        "precision": precision,
        **model_state_bytes(phi, world, stage, precision,
                            zero_math.optimizer_state_tensors(spec.train.optimizer, spec.train.momentum)),
        "comm_elements_per_step": comm_elements_per_step(phi, stage, bool(spec.zero.reshard_after_forward)),
        "comm_bytes_per_step": zero_math.comm_bytes_per_step(
            phi, stage, precision, reshard_after_forward=bool(spec.zero.reshard_after_forward),
            accumulation_steps=spec.accumulation_steps, quantized_weights=spec.zero.quantized_weights,
            quantized_gradients=spec.zero.quantized_gradients) if world > 1 else 0,
    }


def stored_spec(spec_json: dict[str, Any]) -> JobSpec | None:
    """A job row's spec, typed; None when it no longer validates (a page shows that row anyway)."""
    try:
        return typed_spec(spec_json)
    except ValueError:
        return None
