"""Stages 1/2: the parameter all-gathers ``step()`` launches and the next forward waits for.

After the optimizer step each rank holds only its own shard of the updated parameters; the
all-gather that republishes them is launched at the end of ``step()`` and *not* waited there.
Each bucket is waited for just before its first use: a forward pre-hook on every module that
registers one of the bucket's parameters waits for that bucket (the first of those modules to
run does the wait; the others find it done), so the next forward computes on bucket 0 while
buckets 1, 2, ... are still on the wire -- FSDP2's unshard-before-forward, for a model that
keeps its whole parameters.

[Note: every other reader of the parameters waits first]
Between ``step()`` and the next forward a bucket's ``flat_param`` holds this rank's new shard
and the *previous* step's values elsewhere, until its gather is waited. So everything that
reads parameter values outside a forward drains the gathers first:

* a read through the module -- ``model.fc.weight``, ``model.parameters()``,
  ``model.state_dict()``, ``model.to(...)`` -- goes through the module's ``_parameters``, which
  is a ``_GatherGuard``: it waits for the bucket of the parameter read (``__getitem__``,
  ``get``) or for the buckets of the module's parameters (``items``/``values``). This also
  covers a forward that reads another module's parameter (``F.linear(x, self.wte.weight)``
  before ``wte`` ran);
* the engine's own readers wait for every gather: the next ``step()`` (its optimizer writes
  the shard the gather sends from), backward (``begin_micro_step``), ``full_state_dict()``,
  ``state_dict()``, the loaders, ``close()``, and the end of every forward through the engine
  (buckets the forward did not use).

What reads no parameter value does not wait (that would give the overlap back): ``zero_grad``
(gradients only), ``memory()`` and ``comm_volume()`` (storage sizes and counters; a gather
allocates nothing: on Gloo it is one broadcast per rank into ``flat_param``'s own slots, on
NCCL it writes ``flat_param`` directly), ``train()``/``eval()`` (flags). A reference to a
parameter kept from before ``step()`` (``w = model.fc.weight``) reads around the guard: call
``engine.wait_params()`` before reading it.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Optional

import torch.nn as nn

from .collectives import Collectives, Pending
from .parameter_guards import remove_guards

if TYPE_CHECKING:
    from .buckets import FlatBucket

log = logging.getLogger(__name__)


class ParamGathers:
    """The in-flight parameter all-gathers of stages 1/2, one per bucket, and the hooks that wait."""

    def __init__(self, buckets: list["FlatBucket"], comm: Collectives, module: Optional[nn.Module]):
        self.buckets = buckets
        self.comm = comm
        self._pending: dict[int, Pending] = {}  # bucket index -> its gather, launched and not waited
        self._bucket_of = {id(p): i for i, b in enumerate(buckets) for p in b.params}
        self._handles: list = []
        self._guarded: list[nn.Module] = []
        #: without a module (a strategy driven directly) nothing could wait later: ``launch`` waits
        self.deferred = module is not None
        # an engine dropped without close() right after step() still leaves nothing in flight
        # (the script may destroy the process group next): its gathers are waited when it goes
        weakref.finalize(self, _wait_dropped, self._pending)
        if module is not None:
            self._install(module)

    # -- launching and waiting ------------------------------------------------------------------
    def launch(self) -> None:
        """Copy each updated master into its slot of ``flat_param`` and start the bucket's gather.

        In forward order: the layout packs parameters in reverse registration order (the order
        backward produces gradients, ``flat.py``), so the *last* bucket holds what a forward uses
        first (the embeddings) and is launched first; bucket 0 (the last layers) goes last. The
        same order on every rank, as any collective order must be.
        """
        self.wait_all()
        for i in reversed(range(len(self.buckets))):
            b = self.buckets[i]
            shard = b.flat_param[b.shard_slice]
            if shard.data_ptr() != b.master.data_ptr():
                shard.copy_(b.master, non_blocking=True)  # offload: pinned H2D, cast on the device (offload.py)
            self._pending[i] = self.comm.all_gather(b.flat_param, shard, label=f"all_gather bucket {b.spec.index}")
        if not self.deferred:
            self.wait_all()

    @property
    def in_flight(self) -> bool:
        return bool(self._pending)

    def wait(self, index: int) -> None:
        """Wait for bucket ``index``'s gather, if it is still pending."""
        pending = self._pending.pop(index, None)
        if pending is not None:
            pending.wait()

    def wait_all(self) -> None:
        """Wait for every pending gather, in launch order."""
        for index in sorted(self._pending, reverse=True):
            self.wait(index)

    # -- hooks ------------------------------------------------------------------------------------
    def _install(self, module: nn.Module) -> None:
        """A pre-forward wait and a ``_GatherGuard`` on every module registering a bucket's parameter."""
        ref = weakref.ref(self)  # modules must not keep the engine alive (test_lifetime)
        for m in module.modules():
            owned = sorted({self._bucket_of[id(p)] for p in m._parameters.values()
                            if p is not None and id(p) in self._bucket_of})
            if not owned:
                continue
            self._handles.append(m.register_forward_pre_hook(_wait_hook(ref, owned)))
            m._parameters = _GatherGuard(m._parameters, ref, owned)
            self._guarded.append(m)

    def remove_hooks(self) -> None:
        """Remove the waits (``ZeroEngine.remove_hooks``; the delayed-gather test shows what they do)."""
        remove_guards(self._handles, self._guarded)
        self._handles, self._guarded = [], []


def _wait_dropped(pending: dict) -> None:
    """Wait for the gathers of a ``ParamGathers`` being freed, in launch order."""
    for index in sorted(pending, reverse=True):
        try:
            pending.pop(index).wait()
        except RuntimeError as exc:  # the process group is already gone: nothing left to wait for
            log.debug("parameter gather of bucket %d not waited: %s", index, exc)


def _wait_hook(ref: "weakref.ref[ParamGathers]", owned: list[int]):
    def hook(module, args):
        gathers = ref()
        if gathers is not None and gathers._pending:
            for index in owned:
                gathers.wait(index)
    return hook


class _GatherGuard(dict):
    """A module's ``_parameters`` that waits for a parameter's bucket before handing it out.

    ``nn.Module.__getattr__`` reads ``_parameters[name]``, ``named_parameters``/``state_dict``/
    ``_apply`` read ``_parameters.items()``: every read through the module passes here. With no
    gather in flight it is a plain dict lookup. Pickled and copied as a plain dict.
    """

    def __init__(self, params: dict, gathers: "weakref.ref[ParamGathers]", owned: list[int]):
        super().__init__(params)
        self._gathers = gathers
        self._owned = owned

    def _wait(self, value) -> None:
        gathers = self._gathers()
        if gathers is not None and gathers._pending and value is not None:
            index = gathers._bucket_of.get(id(value))
            if index is not None:
                gathers.wait(index)

    def _wait_owned(self) -> None:
        gathers = self._gathers()
        if gathers is not None and gathers._pending:
            for index in self._owned:
                gathers.wait(index)

    def __getitem__(self, name: str):
        value = super().__getitem__(name)
        self._wait(value)
        return value

    def get(self, name, default=None):
        value = super().get(name, default)
        self._wait(value)
        return value

    def items(self):
        self._wait_owned()
        return super().items()

    def values(self):
        self._wait_owned()
        return super().values()

    def __reduce_ex__(self, protocol):
        return dict, (dict(self),)
