"""Reads of a parameter whose all-gather is still in flight wait for it, so the gather can overlap
the next forward without anyone seeing half-updated weights.

After `ShardedOptimizer.step()` launches the parameter all-gathers, each module's forward
pre-hook waits only for the buckets that hold its own parameters: that is the overlap. Anything
else that touches a parameter before its owner runs — an EMA copy right after `step()`, a module
that borrows another's weight, `state_dict()`, a print — would read it while the gather writes
into it. So while a bucket's gather is in flight its parameters are switched to a subclass of
`nn.Parameter` (`GatheringParameter`) whose `__torch_function__` waits for that bucket, switches
them back, and only then runs the function. Once a bucket has landed its parameters are plain
`nn.Parameter`s again: the forward's GEMMs, which run after the pre-hook waited, never pass
through Python here. Metadata that does not read values (shape, dtype, device, requires_grad,
`.grad`, hooks) does not wait.

What this does not see (a read there may still be torn): a tensor that aliases a parameter's
memory and was made before `step()` (`w = p.data`, a view kept from an earlier step, the
optimizer's flat buffer), code that reads memory without passing through a torch function on
the parameter (a C++/CUDA extension given its data pointer, a CUDA graph replay), and torch
functions run under `torch._C.DisableTorchFunction`.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

_T = torch.Tensor


def _metadata() -> frozenset:
    getters = [getattr(_T, a, None) for a in ("dtype", "shape", "device", "requires_grad", "grad", "is_leaf",
                                              "grad_fn", "layout", "ndim", "is_cuda", "is_meta", "_version", "names")]
    methods = [getattr(_T, m, None) for m in ("size", "dim", "numel", "stride", "get_device", "data_ptr",
                                              "element_size", "nelement", "is_contiguous", "is_floating_point",
                                              "is_complex", "requires_grad_", "register_hook",
                                              "register_post_accumulate_grad_hook", "storage_offset")]
    setters = [_T.grad.__set__, _T.requires_grad.__set__]
    return frozenset([g.__get__ for g in getters if g is not None] + [m for m in methods if m is not None] + setters)


METADATA = _metadata()
"""Torch functions on a parameter that read no values: they do not wait for its gather."""


class GatheringParameter(nn.Parameter):
    """A parameter whose all-gather is in flight: any torch function that reads it waits for the gather first."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func not in METADATA:
            for t in tree_flatten((args, kwargs))[0]:
                if type(t) is GatheringParameter:
                    land = t.__dict__.get("_overlapkit_land")
                    if land is not None:
                        land()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def guard(params: list[nn.Parameter], land) -> None:
    """Make reads of `params` (plain nn.Parameters) call `land()` first, until `release(params)`."""
    for p in params:
        p.__dict__["_overlapkit_land"] = land
        p.__class__ = GatheringParameter


def release(params: list[nn.Parameter]) -> None:
    """`params` are plain nn.Parameters again (their gather has landed)."""
    for p in params:
        if type(p) is GatheringParameter:
            p.__class__ = nn.Parameter
        p.__dict__.pop("_overlapkit_land", None)


def lander(wait_buckets, bucket: int):
    """A callable that waits for `bucket` through a weak reference to its optimizer's `_wait_buckets`."""
    ref = weakref.WeakMethod(wait_buckets)

    def land() -> None:
        wait = ref()
        if wait is not None:
            wait([bucket])
    return land
