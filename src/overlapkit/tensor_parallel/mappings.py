"""The conjugate communication operators of tensor and sequence parallelism (Megatron's f and g).

Each operator is an autograd Function whose backward is the mirror of its forward, so the
communication of backward follows from forward by construction. These are the synchronous
building blocks; the parallel linear layers fuse them with their GEMMs to overlap them.
The sequence-parallel ones split or gather the sequence dim (`dim`, 0 by default for
[seq, batch, hidden]; 1 for [batch, seq, hidden]), the tensor-parallel ones the last (hidden)
dimension; `name` labels the transfer on the timeline.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm


def _gather_dim0(x: torch.Tensor, group, name: str) -> torch.Tensor:
    ws = comm.group_size(group)
    if ws == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((ws * x.shape[0],) + tuple(x.shape[1:]))
    comm.all_gather(out, x, group, kind="tp_all_gather", name=name, async_op=False)
    return out


def _reduce_scatter_dim0(x: torch.Tensor, group, name: str) -> torch.Tensor:
    ws = comm.group_size(group)
    if ws == 1:
        return x
    check_divisible(x.shape[0], ws, "sequence length (dim 0)")
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // ws,) + tuple(x.shape[1:]))
    comm.reduce_scatter(out, x, group, kind="tp_reduce_scatter", name=name, async_op=False)
    return out


def _split_dim0(x: torch.Tensor, group) -> torch.Tensor:
    ws = comm.group_size(group)
    if ws == 1:
        return x
    check_divisible(x.shape[0], ws, "sequence length (dim 0)")
    return x.chunk(ws, dim=0)[comm.group_rank(group)].contiguous()


def _all_reduce(x: torch.Tensor, group, name: str) -> torch.Tensor:
    if comm.group_size(group) == 1:
        return x
    x = x.contiguous().clone()
    comm.all_reduce(x, group, kind="tp_all_reduce", name=name, async_op=False)
    return x


def _gather_last(x: torch.Tensor, group, name: str) -> torch.Tensor:
    ws = comm.group_size(group)
    if ws == 1:
        return x
    stacked = _gather_dim0(x.unsqueeze(0), group, name)  # [ws, ..., d]
    return torch.cat(stacked.unbind(0), dim=-1)


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    ws = comm.group_size(group)
    if ws == 1:
        return x
    check_divisible(x.shape[-1], ws, "last dimension")
    return x.chunk(ws, dim=-1)[comm.group_rank(group)].contiguous()


def _on_dim(fn, x: torch.Tensor, dim: int, *args):
    """fn (a dim-0 helper) applied along `dim`: moved to the front and back (copies only when dim != 0)."""
    if dim == 0 or dim == -x.dim():
        return fn(x, *args)
    return fn(x.movedim(dim, 0), *args).movedim(0, dim).contiguous()


def check_divisible(size: int, ws: int, what: str) -> None:
    if size % ws != 0:
        raise ValueError(f"{what} {size} is not divisible by the tensor-parallel size {ws}")


class _CopyToTP(torch.autograd.Function):
    """f: identity in forward, all-reduce in backward.

    Forward: the replicated input enters the TP region as it is. Backward: partial input grads are summed.
    """

    @staticmethod
    def forward(ctx, x, group, name):
        ctx.group, ctx.name = group, name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group, ctx.name + ".bwd"), None, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce in forward, identity in backward.

    Forward: partial outputs of the row-parallel GEMM are summed. Backward: the grad is already replicated.
    """

    @staticmethod
    def forward(ctx, x, group, name):
        return _all_reduce(x, group, name + ".fwd")

    @staticmethod
    def backward(ctx, g):
        return g, None, None


class _ScatterToSP(torch.autograd.Function):
    """Split the sequence in forward, all-gather it in backward.

    Forward: each rank keeps its slice of the sequence dim. Backward: the slices' grads are gathered.
    """

    @staticmethod
    def forward(ctx, x, group, name, dim):
        ctx.group, ctx.name, ctx.dim = group, name, dim
        return _on_dim(_split_dim0, x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _on_dim(_gather_dim0, g, ctx.dim, ctx.group, ctx.name + ".bwd"), None, None, None


class _GatherFromSP(torch.autograd.Function):
    """All-gather the sequence in forward, reduce-scatter in backward.

    Forward: the full sequence is rebuilt from the slices. Backward: partial grads are summed and re-split.
    """

    @staticmethod
    def forward(ctx, x, group, name, dim):
        ctx.group, ctx.name, ctx.dim = group, name, dim
        return _on_dim(_gather_dim0, x, dim, group, name + ".fwd")

    @staticmethod
    def backward(ctx, g):
        return _on_dim(_reduce_scatter_dim0, g, ctx.dim, ctx.group, ctx.name + ".bwd"), None, None, None


class _ReduceScatterToSP(torch.autograd.Function):
    """Reduce-scatter the sequence in forward, all-gather in backward.

    Forward: partial outputs are summed and each rank keeps its slice. Backward: the slices' grads are gathered.
    """

    @staticmethod
    def forward(ctx, x, group, name, dim):
        ctx.group, ctx.name, ctx.dim = group, name, dim
        return _on_dim(_reduce_scatter_dim0, x, dim, group, name + ".fwd")

    @staticmethod
    def backward(ctx, g):
        return _on_dim(_gather_dim0, g, ctx.dim, ctx.group, ctx.name + ".bwd"), None, None, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather the last dimension in forward, split it in backward.

    Forward: column-parallel output shards are concatenated. Backward: each rank keeps its shard's grad.
    """

    @staticmethod
    def forward(ctx, x, group, name):
        ctx.group = group
        return _gather_last(x, group, name + ".fwd")

    @staticmethod
    def backward(ctx, g):
        return _split_last(g, ctx.group), None, None


class _ScatterToTP(torch.autograd.Function):
    """Split the last dimension in forward, all-gather it in backward.

    Forward: a replicated input is cut for the row-parallel GEMM. Backward: the shards' grads are concatenated.
    """

    @staticmethod
    def forward(ctx, x, group, name):
        ctx.group, ctx.name = group, name
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, g):
        return _gather_last(g, ctx.group, ctx.name + ".bwd"), None, None


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup, name: str = "copy_to_tp") -> torch.Tensor:
    return _CopyToTP.apply(x, group, name)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup, name: str = "reduce_from_tp") -> torch.Tensor:
    return _ReduceFromTP.apply(x, group, name)


def scatter_to_sp(x: torch.Tensor, group: dist.ProcessGroup, name: str = "scatter_to_sp", *,
                  dim: int = 0) -> torch.Tensor:
    """Keep this rank's slice of the sequence dim `dim` (0: [s, b, h]; 1: [b, s, h])."""
    return _ScatterToSP.apply(x, group, name, dim)


def gather_from_sp(x: torch.Tensor, group: dist.ProcessGroup, name: str = "gather_from_sp", *,
                   dim: int = 0) -> torch.Tensor:
    """All-gather the sequence dim `dim`."""
    return _GatherFromSP.apply(x, group, name, dim)


def reduce_scatter_to_sp(x: torch.Tensor, group: dist.ProcessGroup, name: str = "reduce_scatter_to_sp", *,
                         dim: int = 0) -> torch.Tensor:
    """Sum over TP and keep this rank's slice of the sequence dim `dim`."""
    return _ReduceScatterToSP.apply(x, group, name, dim)


def gather_from_tp(x: torch.Tensor, group: dist.ProcessGroup, name: str = "gather_from_tp") -> torch.Tensor:
    return _GatherFromTP.apply(x, group, name)


def scatter_to_tp(x: torch.Tensor, group: dist.ProcessGroup, name: str = "scatter_to_tp") -> torch.Tensor:
    return _ScatterToTP.apply(x, group, name)
