"""What a rank writes besides the metric push: rank 0's progress lines in the job's log, and
every record appended to a local JSONL file (``LoopConfig.metrics_path``: offline runs, tests)."""

from __future__ import annotations

import json
from typing import Any

from contract.metrics import THROUGHPUT

PROGRESS_LINES = 20  # rank 0 prints about this many progress lines per run, plus the first and last step


def shows_progress(step: int, total_steps: int) -> bool:
    return step in (1, total_steps) or step % max(1, total_steps // PROGRESS_LINES) == 0


def progress_line(record: dict[str, Any], total_steps: int, world_size: int) -> str:
    """One readable line of the job's log (rank 0): what ``zerotrain logs`` and the dashboard show.
    Throughput is the job's (this rank's share times the world size, as the dashboard counts it)."""
    parts = [f"step {record['step']}/{total_steps}", f"loss {record['loss']:.4f}"]
    if record.get("lr") is not None:
        parts.append(f"lr {record['lr']:.2e}")
    if record.get("step_time_s") is not None:
        parts.append(f"{record['step_time_s']:.2f} s/step")
    if record.get(THROUGHPUT) is not None:
        parts.append(f"{record[THROUGHPUT] * world_size:,.0f} tokens/s")
    if record.get("eval_loss") is not None:
        parts.append(f"eval loss {record['eval_loss']:.4f}")
    return "  ".join(parts)


class JsonlSink:
    """Every record of this rank appended to a local file (offline runs and tests)."""

    def __init__(self, path: str):
        self.file = open(path, "a", encoding="utf-8")

    def report(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self, timeout_s: float = 0.0) -> int:
        self.file.close()
        return 0
