"""What a training step holds for its backward, on a device without allocator statistics (CPU).

`held_peak_bytes` counts, while `step()` runs, every tensor autograd saves for backward, each storage once while
any saved tensor on it is alive, and returns the most held at one time. A plain step holds all of it at the end
of its forward; a pipeline's step holds several micro-batches' activations at once and frees each as its
backward runs, so its peak is not the sum of what it saved. Storages in `exclude` (the parameters and the
optimizer's state, which a state count already holds) are left out. Transients inside an op are not seen.
"""

from __future__ import annotations

import weakref

import torch


def storage_of(t: torch.Tensor):
    """The storage under `t`: a DTensor's local shard's; a collective's result still in flight (torch 2.13 saves
    DTensor locals so) is a wrapper with no storage of its own, so the tensor it wraps."""
    local = t.to_local() if hasattr(t, "to_local") else t
    local = getattr(local, "elem", local) if type(local).__name__ == "AsyncCollectiveTensor" else local
    return local.untyped_storage()


def storages(*tensor_lists) -> set[int]:
    """The data pointers of the storages under every tensor of `tensor_lists` (for `exclude`)."""
    return {storage_of(t).data_ptr() for ts in tensor_lists for t in ts if isinstance(t, torch.Tensor)}


class _Held:
    """What autograd keeps for one saved tensor while the hook is on: alive exactly as long as the saved tensor."""

    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def held_peak_bytes(step, exclude: set[int] = frozenset()) -> int:
    """The most bytes of saved-for-backward storages alive at once during `step()` (see the module docstring)."""
    live: dict[int, list[int]] = {}  # storage pointer -> [bytes, saved tensors alive on it]
    held = [0, 0]  # now, peak

    def release(ptr: int) -> None:
        entry = live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            held[0] -= entry[0]
            del live[ptr]

    def pack(t: torch.Tensor):
        s = storage_of(t)
        ptr = s.data_ptr()
        if ptr == 0 or ptr in exclude:
            return t
        if ptr not in live:
            live[ptr] = [s.nbytes(), 0]
            held[0] += s.nbytes()
            held[1] = max(held[1], held[0])
        live[ptr][1] += 1
        h = _Held(t)
        weakref.finalize(h, release, ptr)
        return h

    def unpack(h):
        return h.t if isinstance(h, _Held) else h

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        step()
    return held[1]
