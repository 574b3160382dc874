"""The end of an engine's process groups: ``ZeroEngine.close(destroy_group=True)``.

[Note: why close() can destroy the group]
Gloo's ``ProcessGroupGloo`` runs each group's work on C++ worker threads (two per group, plus a
transport loop thread; rank 0 also runs the TCPStore server's thread). A worker keeps the work it
ran (and so its tensors) until it takes the next one, a moment after the waiter was woken; a
tensor whose Python object died meanwhile is freed by that worker, and freeing it takes the GIL.
``dist.destroy_process_group()`` on Gloo only forgets the group: the C++ group, its threads and
the store live for as long as anything holds the Python group object -- an engine kept in a
module global does until interpreter shutdown. Once shutdown has begun, CPython 3.11 ends any
other thread that asks for the GIL with ``pthread_exit``; unwinding that C++ worker through a
``noexcept`` destructor calls ``std::terminate``: the rank dies of SIGABRT with "terminate called
without an active exception", after training succeeded. ``destroy_groups`` therefore destroys
the groups while the interpreter is fully alive *and* drops every reference the engine and
``hybrid.py``'s and ``hpz.py``'s caches hold, so the C++ groups are destroyed right here: their destructors (GIL
released) join every worker, transport and store thread, and nothing of Gloo's is left to run
at interpreter shutdown.

[Note: torch pins the default group]
Dropping our references is not enough: ``torch.distributed.nn.functional`` declares ``group=
group.WORLD`` as a default argument of ten functions, evaluated when it is imported. It is
imported lazily, with ``torch._dynamo`` (``torch.distributed.fsdp`` -> ``_shard``), by the first
``torch.optim.Optimizer`` built in the process -- after ``init_process_group`` in every script
that builds its optimizer then, ours and DDP's alike. From then on those defaults hold the
default group, so ``destroy_process_group()`` can never free it and its threads always run into
interpreter shutdown. ``_unpin`` replaces that group in the defaults by ``None`` (which the
functions read as the default group, whatever it is then) before the group is destroyed.
"""

from __future__ import annotations

import gc
import sys
from typing import Optional

import torch.distributed as dist

from . import hpz, hybrid


def destroy_groups(comm) -> None:
    """Destroy the process groups ``comm`` (a ``Collectives``) runs on and forget them (the note).

    When the engine runs on the default group: ``dist.destroy_process_group()`` (every group of
    the process, as a script's last line would); otherwise the engine's own groups (hybrid
    sharding's shard and replicate groups, hpZ's group: ``hpz.py``), then the group it was given. Local: every rank calls
    it after ``close()``'s barrier, so no peer still communicates.
    """
    dp_group: Optional[dist.ProcessGroup] = comm.dp_group
    own = [g for g in (comm.group, comm.replicate_group) if g is not None and g is not dp_group]
    own += [g for g in hpz.forget(dp_group) if g is not None and all(g is not o for o in own)]
    comm.dp_group = comm.group = comm.replicate_group = None
    hybrid.forget(dp_group)
    if dp_group is not None and dist.is_initialized():
        if dp_group is dist.group.WORLD:
            _unpin(dp_group)
            dist.destroy_process_group()
        else:
            for group in own + [dp_group]:
                dist.destroy_process_group(group)
            del group
    del dp_group, own
    gc.collect()  # a cycle that still holds a group would keep its threads to interpreter shutdown


def _unpin(group: dist.ProcessGroup) -> None:
    """Take ``group`` out of ``torch.distributed.nn.functional``'s default arguments (the note)."""
    module = sys.modules.get("torch.distributed.nn.functional")
    if module is None:
        return
    for value in list(vars(module).values()):
        defaults = getattr(value, "__defaults__", None)
        if isinstance(defaults, tuple) and any(d is group for d in defaults):
            value.__defaults__ = tuple(None if d is group else d for d in defaults)
