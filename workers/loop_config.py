"""``LoopConfig``: what one job's training loop is told, the same on every rank.

The driver (``workers.launch``) builds it once and the runtime carries it to every rank, where
``workers.train.train_loop`` reads it; ``run_local`` and tests build it directly. Plain values
only, so it pickles across any runtime. What a runtime itself owns (worker-group number, resize
gate) is not here but in ``workers.run_context.RunContext``; the ingest token is not here either:
it comes from the environment (``contract.environment.INGEST_TOKEN_ENV``), never the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class LoopConfig:
    """``spec``: the job spec as JSON; each rank validates it into ``contract.spec.JobSpec`` on
    arrival and reads attributes from then on (every default is the spec's). ``api_url``: where
    the control plane is; None: no state reports, no metric push. ``attempt_base``: the job's
    attempt before this run; worker group k of the run is attempt ``attempt_base + k``.
    ``metrics_path``: also append every record to ``{metrics_path}.rank{r}.jsonl``.
    ``storage_uri``: the storage root (checkpoints go under ``{storage}/{job_id}/checkpoints``)."""

    spec: dict[str, Any]
    job_id: str
    api_url: Optional[str] = None
    attempt_base: int = 0
    metrics_path: Optional[str] = None
    storage_uri: Optional[str] = None
