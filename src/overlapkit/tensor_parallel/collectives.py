"""The synchronous tensor-parallel collectives on dim 0, in eager code and as ops torch.compile keeps in its graph.

Nothing here overlaps anything: these are the blocking all-gather, reduce-scatter and all-reduce
that the conjugate operators (mappings.py), the vocabulary-parallel embedding and loss, and the
none/bulk linears' bodies run. In eager code they go through `overlapkit.runtime.comm` (so the timeline
sees them). Dynamo cannot trace an asynchronous collective and breaks the graph at each; under
torch.compile each is instead one opaque custom op (`overlapkit::tp_*`) with a fake kernel for its
shape, whose body is the same eager code, run when the graph runs. Each op compares its
signature (shape, dtype, name) across the group the first time it runs, as the layers do in eager,
so a rank with another shape fails by name instead of meeting the others' transfer with the wrong
byte count.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime import comm
from ..runtime import state
from ..runtime.agreement import Agreement

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def _group(name: str):
    return dist.distributed_c10d._resolve_process_group(name)


def check_divisible(size: int, ws: int, what: str) -> None:
    if size % ws != 0:
        raise ValueError(f"{what} {size} is not divisible by the tensor-parallel size {ws}")


def gather_dim0(x: torch.Tensor, group, name: str) -> torch.Tensor:
    """All-gather of x over `group` along dim 0 (rank order); x itself on one rank."""
    ws = comm.group_size(group)
    if ws == 1:
        return x
    if torch.compiler.is_compiling():
        return torch.ops.overlapkit.tp_all_gather(x.contiguous(), group.group_name, name)
    x = x.contiguous()
    out = x.new_empty((ws * x.shape[0],) + tuple(x.shape[1:]))
    comm.all_gather(out, x, group, kind="tp_all_gather", name=name, async_op=False)
    return out


def reduce_scatter_dim0(x: torch.Tensor, group, name: str) -> torch.Tensor:
    """Sum of x over `group`, this rank's slice of dim 0 kept; x itself on one rank."""
    ws = comm.group_size(group)
    if ws == 1:
        return x
    check_divisible(x.shape[0], ws, "sequence length (dim 0)")
    if torch.compiler.is_compiling():
        return torch.ops.overlapkit.tp_reduce_scatter(x.contiguous(), group.group_name, name)
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // ws,) + tuple(x.shape[1:]))
    comm.reduce_scatter(out, x, group, kind="tp_reduce_scatter", name=name, async_op=False)
    return out


def all_reduce_copy(x: torch.Tensor, group, name: str, op: str = "sum") -> torch.Tensor:
    """A new tensor holding x reduced over `group` (`op` "sum" or "max"); x itself on one rank."""
    if comm.group_size(group) == 1:
        return x
    if torch.compiler.is_compiling():
        return torch.ops.overlapkit.tp_all_reduce(x.contiguous(), group.group_name, name, op)
    out = x.contiguous().clone()
    comm.all_reduce(out, group, kind="tp_all_reduce", name=name, async_op=False, op=_REDUCE_OPS[op])
    return out


def split_dim0(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's slice of dim 0 (no communication); x itself on one rank."""
    ws = comm.group_size(group)
    if ws == 1:
        return x
    check_divisible(x.shape[0], ws, "sequence length (dim 0)")
    return x.chunk(ws, dim=0)[comm.group_rank(group)].contiguous()


# -- the ops torch.compile sees ---------------------------------------------------------------

_LIB = torch.library.Library("overlapkit", "FRAGMENT")
_AGREED: dict[str, Agreement] = state.cache_dict("tp.compiled_collective_checks")
"""Per op name: the signatures already compared across the ranks."""


def _agree(kind: str, x: torch.Tensor, group, name: str, **extra) -> None:
    agreement = _AGREED.setdefault(kind, Agreement(f"overlapkit::{kind}"))
    agreement.check(group, name=name, shape=tuple(x.shape), dtype=x.dtype, **extra)


def _all_gather_impl(x, group, name):
    pg = _group(group)
    _agree("tp_all_gather", x, pg, name)
    ws = comm.group_size(pg)
    out = x.new_empty((ws * x.shape[0],) + tuple(x.shape[1:]))
    comm.all_gather(out, x, pg, kind="tp_all_gather", name=name, async_op=False)
    return out


def _reduce_scatter_impl(x, group, name):
    pg = _group(group)
    _agree("tp_reduce_scatter", x, pg, name)
    out = x.new_empty((x.shape[0] // comm.group_size(pg),) + tuple(x.shape[1:]))
    comm.reduce_scatter(out, x, pg, kind="tp_reduce_scatter", name=name, async_op=False)
    return out


def _all_reduce_impl(x, group, name, op):
    pg = _group(group)
    _agree("tp_all_reduce", x, pg, name, op=op)
    out = x.clone()
    comm.all_reduce(out, pg, kind="tp_all_reduce", name=name, async_op=False, op=_REDUCE_OPS[op])
    return out


_LIB.define("tp_all_gather(Tensor x, str group, str name) -> Tensor")
_LIB.define("tp_reduce_scatter(Tensor x, str group, str name) -> Tensor")
_LIB.define("tp_all_reduce(Tensor x, str group, str name, str op) -> Tensor")
_LIB.impl("tp_all_gather", _all_gather_impl, "CompositeExplicitAutograd")
_LIB.impl("tp_reduce_scatter", _reduce_scatter_impl, "CompositeExplicitAutograd")
_LIB.impl("tp_all_reduce", _all_reduce_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("overlapkit::tp_all_gather", lib=_LIB)
def _(x, group, name):
    return x.new_empty((dist.get_world_size(_group(group)) * x.shape[0],) + tuple(x.shape[1:]))


@torch.library.register_fake("overlapkit::tp_reduce_scatter", lib=_LIB)
def _(x, group, name):
    return x.new_empty((x.shape[0] // dist.get_world_size(_group(group)),) + tuple(x.shape[1:]))


@torch.library.register_fake("overlapkit::tp_all_reduce", lib=_LIB)
def _(x, group, name, op):
    return torch.empty_like(x)
