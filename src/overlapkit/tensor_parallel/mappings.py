"""The conjugate communication operators of tensor and sequence parallelism (Megatron's f and g).

Each operator is an autograd Function whose backward is the mirror of its forward, so the
communication of backward follows from forward by construction. These are the synchronous
building blocks; the parallel linear layers fuse them with their GEMMs to overlap them.
On a group of one rank each is the identity and returns its input itself (no autograd node).
The sequence-parallel ones split or gather the sequence dim (`dim`, 0 by default for
[seq, batch, hidden]; 1 for [batch, seq, hidden]), the tensor-parallel ones the last (hidden)
dimension; `name` labels the transfer on the timeline.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime import comm
from .collectives import all_reduce_copy, check_divisible, gather_dim0, reduce_scatter_dim0, split_dim0

def _gather_last(x: torch.Tensor, group, name: str) -> torch.Tensor:
    ws = comm.group_size(group)
    if ws == 1:
        return x
    stacked = gather_dim0(x.unsqueeze(0), group, name)  # [ws, ..., d]
    return torch.cat(stacked.unbind(0), dim=-1)


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    ws = comm.group_size(group)
    if ws == 1:
        return x
    check_divisible(x.shape[-1], ws, "last dimension")
    return x.chunk(ws, dim=-1)[comm.group_rank(group)].contiguous()


def _on_dim(fn, x: torch.Tensor, dim: int, *args):
    """fn (a dim-0 helper) applied along `dim`, moved to the front and back.

    The result is `dim`-major (a view of fn's dim-0-first output, not copied back): inside a
    sequence-parallel region every layer reads and returns that layout (layout.py), so keeping
    it saves a transpose copy at every region boundary.
    """
    if dim == 0 or dim == -x.dim():
        return fn(x, *args)
    return fn(x.movedim(dim, 0), *args).movedim(0, dim)


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
        return all_reduce_copy(g, ctx.group, ctx.name + ".bwd"), None, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce in forward, identity in backward.

    Forward: partial outputs of the row-parallel GEMM are summed. Backward: the grad is already replicated.
    """

    @staticmethod
    def forward(ctx, x, group, name):
        return all_reduce_copy(x, group, name + ".fwd")

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
        return _on_dim(split_dim0, x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _on_dim(gather_dim0, g, ctx.dim, ctx.group, ctx.name + ".bwd"), None, None, None


class _GatherFromSP(torch.autograd.Function):
    """All-gather the sequence in forward, reduce-scatter in backward.

    Forward: the full sequence is rebuilt from the slices. Backward: partial grads are summed and re-split.
    """

    @staticmethod
    def forward(ctx, x, group, name, dim):
        ctx.group, ctx.name, ctx.dim = group, name, dim
        return _on_dim(gather_dim0, x, dim, group, name + ".fwd")

    @staticmethod
    def backward(ctx, g):
        return _on_dim(reduce_scatter_dim0, g, ctx.dim, ctx.group, ctx.name + ".bwd"), None, None, None


class _ReduceScatterToSP(torch.autograd.Function):
    """Reduce-scatter the sequence in forward, all-gather in backward.

    Forward: partial outputs are summed and each rank keeps its slice. Backward: the slices' grads are gathered.
    """

    @staticmethod
    def forward(ctx, x, group, name, dim):
        ctx.group, ctx.name, ctx.dim = group, name, dim
        return _on_dim(reduce_scatter_dim0, x, dim, group, name + ".fwd")

    @staticmethod
    def backward(ctx, g):
        return _on_dim(gather_dim0, g, ctx.dim, ctx.group, ctx.name + ".bwd"), None, None, None


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
    return x if comm.group_size(group) == 1 else _CopyToTP.apply(x, group, name)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup, name: str = "reduce_from_tp") -> torch.Tensor:
    return x if comm.group_size(group) == 1 else _ReduceFromTP.apply(x, group, name)


def scatter_to_sp(x: torch.Tensor, group: dist.ProcessGroup, name: str = "scatter_to_sp", *,
                  dim: int = 0) -> torch.Tensor:
    """Keep this rank's slice of the sequence dim `dim` (0: [s, b, h]; 1: [b, s, h])."""
    return x if comm.group_size(group) == 1 else _ScatterToSP.apply(x, group, name, dim)


def gather_from_sp(x: torch.Tensor, group: dist.ProcessGroup, name: str = "gather_from_sp", *,
                   dim: int = 0) -> torch.Tensor:
    """All-gather the sequence dim `dim`."""
    return x if comm.group_size(group) == 1 else _GatherFromSP.apply(x, group, name, dim)


def reduce_scatter_to_sp(x: torch.Tensor, group: dist.ProcessGroup, name: str = "reduce_scatter_to_sp", *,
                         dim: int = 0) -> torch.Tensor:
    """Sum over TP and keep this rank's slice of the sequence dim `dim`."""
    return x if comm.group_size(group) == 1 else _ReduceScatterToSP.apply(x, group, name, dim)


def gather_from_tp(x: torch.Tensor, group: dist.ProcessGroup, name: str = "gather_from_tp") -> torch.Tensor:
    return x if comm.group_size(group) == 1 else _GatherFromTP.apply(x, group, name)


def scatter_to_tp(x: torch.Tensor, group: dist.ProcessGroup, name: str = "scatter_to_tp") -> torch.Tensor:
    return x if comm.group_size(group) == 1 else _ScatterToTP.apply(x, group, name)
