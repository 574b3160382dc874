"""The end of an engine's process groups: ``ZeroEngine.close(destroy_group=True)``, and what is
left of them at interpreter exit after the caller destroyed the group (``release_dead_groups``).

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

[Note: the endings users write]
Scripts end with ``engine.close()`` then ``dist.destroy_process_group()`` (or destroy the group
with the engine still alive), not with ``close(destroy_group=True)``; the engine, a module
global, then holds the dead group until interpreter shutdown, and torch's defaults hold it for
good. So every engine's ``Collectives`` is registered here when it is built
(``released_at_exit``), weakly, and the first registration adds ``release_dead_groups`` to
``atexit``. Python runs ``atexit`` functions while the interpreter is fully alive, before
shutdown begins; there, if the default group is no longer initialized -- the caller destroyed
it, so every group of the process is dead -- the function stops the watchdog thread, drops
what the registered engines, ``hybrid.py``'s and ``hpz.py``'s caches and torch's defaults still
hold of the dead groups, lets go of the works still in flight (an engine never closed: their
handles hold the Gloo context, and with it the transport thread and the store) and collects
them: the C++ groups are destroyed then and their threads joined (a group's destructor first
lets its queued works finish), as ``close(destroy_group=True)`` would have done. A group
still initialized at exit is the caller's (Ray Train's, or a script that never destroyed it):
it is left alone, and ``close()`` itself never destroys a group unless asked.
"""

from __future__ import annotations

import atexit
import gc
import sys
import weakref
from typing import Optional

import torch.distributed as dist

from . import hpz, hybrid
from .watchdog import stop_watchdog

#: every engine's ``Collectives`` with a process group, weakly (the note on the endings users write)
_REGISTERED: "weakref.WeakSet" = weakref.WeakSet()
_hooked = False  # release_dead_groups is in atexit


def destroy_groups(comm) -> None:
    """Destroy the process groups ``comm`` (a ``Collectives``) runs on and forget them (the note).

    When the engine runs on the default group: ``dist.destroy_process_group()`` (every group of
    the process, as a script's last line would); otherwise the engine's own groups (hybrid
    sharding's shard and replicate groups, hpZ's group: ``hpz.py``), then the group it was given. Local: every rank calls
    it after ``close()``'s barrier, so no peer still communicates.
    """
    dp_group, own = _forget(comm)
    if dp_group is not None and dist.is_initialized():
        if dp_group is dist.group.WORLD:
            _unpin(lambda g, world=dp_group: g is world)
            dist.destroy_process_group()
        else:
            for group in own + [dp_group]:
                dist.destroy_process_group(group)
            del group
    del dp_group, own
    gc.collect()  # a cycle that still holds a group would keep its threads to interpreter shutdown


def _forget(comm) -> tuple[Optional[dist.ProcessGroup], list[dist.ProcessGroup]]:
    """Take every group out of ``comm`` and the caches; returns its data-parallel group and its own groups."""
    dp_group: Optional[dist.ProcessGroup] = comm.dp_group
    own = [g for g in (comm.group, comm.replicate_group) if g is not None and g is not dp_group]
    own += [g for g in hpz.forget(dp_group) if g is not None and all(g is not o for o in own)]
    comm.dp_group = comm.group = comm.replicate_group = None
    hybrid.forget(dp_group)
    return dp_group, own


def released_at_exit(comm):
    """Register ``comm`` (a ``Collectives``) for ``release_dead_groups`` at interpreter exit; returns it."""
    global _hooked
    if comm.dp_group is not None:
        if not _hooked:
            atexit.register(release_dead_groups)
            _hooked = True
        _REGISTERED.add(comm)
    return comm


def release_dead_groups() -> bool:
    """At exit: if the caller destroyed the default group, drop and collect what still holds the dead
    groups so their threads are joined before interpreter shutdown (the note). Returns whether it did."""
    if dist.is_initialized() or not _REGISTERED:
        return False  # the group is alive: the caller's to end, not ours
    stop_watchdog()
    for comm in list(_REGISTERED):
        comm.abandon_pending()  # in flight (a bare destroy after step()): the handles hold the context
        _forget(comm)
    _REGISTERED.clear()
    hybrid.forget_all()  # engines gone since may have left their groups cached
    hpz.forget_all()
    _unpin(lambda g: isinstance(g, dist.ProcessGroup))  # the default group is gone: every group is dead
    gc.collect()
    return True


def _unpin(dead) -> None:
    """Replace the groups ``dead(group)`` picks in ``torch.distributed.nn.functional``'s default arguments
    by ``None`` (the note on torch pinning the default group)."""
    module = sys.modules.get("torch.distributed.nn.functional")
    if module is None:
        return
    for value in list(vars(module).values()):
        defaults = getattr(value, "__defaults__", None)
        if isinstance(defaults, tuple) and any(dead(d) for d in defaults):
            value.__defaults__ = tuple(None if dead(d) else d for d in defaults)
