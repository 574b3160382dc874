"""``keep_last``: how old checkpoints go away without ever leaving a half one that looks whole.

For each checkpoint beyond the newest ``keep_last`` committed ones, in this order:

1. delete ``manifest.json`` -- the checkpoint stops existing (decommitted) at once, so a crash
   later in the deletion leaves debris, never a manifest that points at missing shards;
2. delete its shard objects, then the directory;
3. forget its record in the control plane.

Objects go first and records last, so a listed checkpoint's files may be gone for a moment,
but a record never outlives a failed deletion unnoticed: the next run of ``prune`` finds the
leftover directory as debris and repeats steps 2–3. Every step is idempotent: an object or
record that is already gone counts as deleted.

Debris: a ``step_*`` directory without a manifest, older than the checkpoint just committed,
is what a crashed save or a crashed deletion left behind; it is deleted the same way. A newer
one cannot be debris of this job's run (saves are sequential), so it is left alone.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from storage.manifest import MANIFEST, committed_steps, step_dirs
from storage.storage import Storage

log = logging.getLogger(__name__)


def prune(checkpoints: Storage, keep_last: int, *, current_step: int,
          forget: Optional[Callable[[int], None]] = None) -> list[int]:
    """Delete what ``keep_last`` no longer keeps; return the steps deleted (ascending)."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    dirs = step_dirs(checkpoints)
    committed = committed_steps(checkpoints)
    doomed = set(committed[:-keep_last])
    doomed |= {s for s in dirs if s not in committed and s < current_step}
    for step in sorted(doomed):
        delete_checkpoint(checkpoints, dirs[step], step, forget)
    return sorted(doomed)


def delete_checkpoint(checkpoints: Storage, dirname: str, step: int,
                      forget: Optional[Callable[[int], None]] = None) -> None:
    checkpoints.remove([f"{dirname}/{MANIFEST}"])
    checkpoints.remove(f"{dirname}/{name}" for name in checkpoints.list_files(dirname))
    checkpoints.remove_tree(dirname)
    if forget is not None:
        forget(step)
    log.info("deleted checkpoint step %d (%s/%s)", step, checkpoints.uri, dirname)
