"""What a test counts as memory held: the bytes of every tensor storage Python can reach."""

from __future__ import annotations

import gc
import warnings

import torch


def live_tensor_bytes() -> int:
    """Bytes of every distinct non-meta tensor storage Python can reach now."""
    seen, total = set(), 0
    with warnings.catch_warnings():  # isinstance() wakes deprecated lazy attributes of some modules
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor) and not obj.is_meta]
    for obj in tensors:
        storage = obj.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total
