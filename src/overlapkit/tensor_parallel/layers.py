"""Column- and row-parallel linear layers, with sequence parallelism, whose backward hides its communication.

overlap="none": every collective is synchronous — the reference.
overlap="bulk": Megatron's scheme. The column layer's backward issues the re-gather of its
sequence-parallel input asynchronously and computes the dgrad GEMM under it, then issues the
dgrad reduce-scatter (or all-reduce without SP) asynchronously and computes the wgrad GEMM
under it. The row layer has no independent GEMM to hide its collectives behind (both of its
backward GEMMs need the gathered output gradient), so bulk equals none there.
overlap="pipelined" (sequence parallelism only): the all-gather and reduce-scatter are cut into
`chunks` and pipelined with the GEMMs that need them, forward and backward, over `transport`
"p2p" or "symm_mem" (see pipelined.py).
overlap="auto": the cost model (overlapkit.costmodel.choose_tp_overlap) picks none, bulk or
pipelined with a chunk count for this layer's GEMM at the first input of each shape, from the
GEMM-efficiency curve of `hardware` (a preset, or a file written by `overlapkit bench gemm`).

Layout: weights are nn.Linear's [out, in]; the sequence-parallel dimension is dim 0 of the
activation ([tokens, hidden] or [seq, batch, hidden]).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..timeline.recorder import compute_span
from .mappings import _gather_dim0, _reduce_scatter_dim0, check_divisible, gather_from_tp, scatter_to_tp
from .pipelined import check_layer_options, column_parallel_linear_pipelined, row_parallel_linear_pipelined

OVERLAP_MODES = ("none", "bulk", "pipelined", "auto")
"""Accepted values of the layers' `overlap`."""


def check_overlap(overlap: str, allowed=OVERLAP_MODES) -> str:
    if overlap not in allowed:
        raise ValueError(f"overlap={overlap!r} is not one of {allowed}")
    return overlap


def _check_input(layer: nn.Module, x: torch.Tensor, in_features: int, sp_split: bool) -> None:
    """Shape, dtype and device checks, done before any collective so every rank fails alike."""
    w = layer.weight
    name = layer.name or type(layer).__name__
    if x.dim() < 2:
        raise ValueError(f"{name}: input must have at least 2 dims [tokens, hidden], got shape {tuple(x.shape)}")
    if x.shape[-1] != in_features:
        raise ValueError(f"{name}: input's last dim is {x.shape[-1]}, expected {in_features}")
    if x.dtype != w.dtype:
        raise ValueError(f"{name}: input dtype {x.dtype} differs from the weight dtype {w.dtype}")
    if x.device != w.device:
        raise ValueError(f"{name}: input is on {x.device}, the weight on {w.device}")
    if sp_split:
        check_divisible(x.shape[0], layer.tp_size, f"{name}: sequence length (dim 0)")


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, name: str) -> torch.Tensor:
    with compute_span(name):
        return torch.nn.functional.linear(x, w, b)


def _wgrad(dy: torch.Tensor, x: torch.Tensor, has_bias: bool, name: str):
    with compute_span(name):
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        return dy2.t() @ x2, (dy2.sum(0) if has_bias else None)


class _ColumnLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, sp, bulk, name):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.sp, ctx.bulk, ctx.name, ctx.has_bias = group, sp, bulk, name, bias is not None
        total = _gather_dim0(x, group, name + ".fwd") if sp else x
        return _linear(total, weight, bias, name + ".fwd.gemm")

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        group, name, ws = ctx.group, ctx.name, comm.group_size(ctx.group)
        dy = dy.contiguous()
        regather = None
        if ctx.sp and ws > 1:
            # Megatron keeps only the input shard; the full input for wgrad is re-gathered
            # now, under the dgrad GEMM.
            total = x.new_empty((ws * x.shape[0],) + tuple(x.shape[1:]))
            regather = comm.all_gather(total, x.contiguous(), group, kind="tp_all_gather",
                                       name=name + ".bwd", async_op=ctx.bulk)
        else:
            total = x
        with compute_span(name + ".bwd.dgrad"):
            dx_full = dy @ weight
        if regather is not None:
            regather.wait()
        reduce = None
        if ws == 1:
            dx = dx_full
        elif ctx.sp:
            dx = dx_full.new_empty((dx_full.shape[0] // ws,) + tuple(dx_full.shape[1:]))
            reduce = comm.reduce_scatter(dx, dx_full, group, kind="tp_reduce_scatter",
                                         name=name + ".bwd", async_op=ctx.bulk)
        else:
            dx = dx_full
            reduce = comm.all_reduce(dx, group, kind="tp_all_reduce", name=name + ".bwd", async_op=ctx.bulk)
        dw, db = _wgrad(dy, total, ctx.has_bias, name + ".bwd.wgrad")
        if reduce is not None:
            reduce.wait()
        return dx, dw, db, None, None, None, None


class _RowLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, sp, name):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.sp, ctx.name, ctx.has_bias = group, sp, name, bias is not None
        partial = _linear(x, weight, None, name + ".fwd.gemm")
        if comm.group_size(group) == 1:
            y = partial
        elif sp:
            y = _reduce_scatter_dim0(partial, group, name + ".fwd")
        else:
            y = partial.contiguous()
            comm.all_reduce(y, group, kind="tp_all_reduce", name=name + ".fwd", async_op=False)
        return y + bias if bias is not None else y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy = dy.contiguous()
        # With SP the bias grad is this rank's tokens only; the TP sum happens in
        # allreduce_sequence_parallel_grads (the bias is marked sequence_parallel).
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias else None
        dy_full = _gather_dim0(dy, ctx.group, ctx.name + ".bwd") if ctx.sp else dy
        with compute_span(ctx.name + ".bwd.dgrad"):
            dx = dy_full @ weight
        dw, _ = _wgrad(dy_full, x, False, ctx.name + ".bwd.wgrad")
        return dx, dw, db, None, None, None


class _ParallelLinear(nn.Module):
    """What the column and row layers share: sizes, group, overlap mode, parameter creation."""

    def __init__(self, in_features: int, out_features: int, group: dist.ProcessGroup, *, bias: bool,
                 sequence_parallel: bool, overlap: str, name: str, device, dtype,
                 transport: str = "p2p", chunks: int | None = None, save_gathered_input: bool = False,
                 hardware: str = "h200-sxm") -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group, self.tp_size, self.tp_rank = group, comm.group_size(group), comm.group_rank(group)
        self.sequence_parallel = sequence_parallel
        self.overlap = check_overlap(overlap)
        check_layer_options(overlap, sequence_parallel, transport, chunks, self.tp_size, save_gathered_input)
        self.transport, self.chunks, self.save_gathered_input = transport, chunks, save_gathered_input
        self.hardware = hardware
        self.auto_choices: dict[tuple, tuple[str, int | None]] = {}
        """overlap='auto': input shape -> (mode, chunks) the cost model chose for it."""
        self.name = name

    def _make_params(self, w_shape, b_shape, fan_in, bias, device, dtype) -> None:
        bound = 1.0 / math.sqrt(fan_in)  # nn.Linear's default init, on the full fan-in
        self.weight = nn.Parameter(torch.empty(w_shape, device=device, dtype=dtype).uniform_(-bound, bound))
        if bias:
            self.bias = nn.Parameter(torch.empty(b_shape, device=device, dtype=dtype).uniform_(-bound, bound))
        else:
            self.register_parameter("bias", None)

    def _maybe_warn(self, x: torch.Tensor, mode: str) -> None:
        if mode == "bulk":
            comm.warn_if_max_connections_unsuited(x.device)

    def _mode(self, x: torch.Tensor, m: int, k: int, n: int, collective: str, rows_per_rank: int):
        """(mode, chunks) for this input: the fixed setting, or the cost model's pick under auto."""
        if self.overlap != "auto":
            return self.overlap, self.chunks
        key = (tuple(x.shape), x.dtype)
        if key not in self.auto_choices:
            from ..costmodel import ConfigError, choose_tp_overlap
            try:
                mode, chunks = choose_tp_overlap(m, k, n, self.tp_size, x.element_size(), self.hardware,
                                                 comm=collective, transport=self.transport)
            except ConfigError as e:
                raise ValueError(f"{self.name or type(self).__name__}: overlap='auto': {e}") from None
            if mode == "pipelined" and not self.sequence_parallel:
                mode = "bulk"  # only the sequence-parallel collectives can be chunked
            # The model counts chunks over all ranks; keep them only if they split this shard evenly.
            ok = mode == "pipelined" and chunks % self.tp_size == 0 and rows_per_rank % (chunks // self.tp_size) == 0
            self.auto_choices[key] = (mode, chunks if ok else None)
        return self.auto_choices[key]

    @classmethod
    def from_full(cls, linear: nn.Linear, group: dist.ProcessGroup, **kwargs):
        """This rank's shard of an unsharded nn.Linear (same dtype and device); kwargs go to the layer."""
        layer = cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
        with torch.no_grad():
            layer.weight.copy_(layer.shard_of(linear.weight))
            if linear.bias is not None:
                layer.bias.copy_(layer.shard_of(linear.bias))
        return layer

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.tp_size}, "
                f"sp={self.sequence_parallel}, overlap={self.overlap!r}")


class ColumnParallelLinear(_ParallelLinear):
    """y = x W^T + b with W split by output rows over the TP group; output is this rank's columns.

    With sequence_parallel the input is this rank's slice of dim 0 and is all-gathered first;
    without it the input is replicated and its gradient is all-reduced in backward.
    gather_output concatenates the output columns of every rank (last dim).
    """

    def __init__(self, in_features: int, out_features: int, group: dist.ProcessGroup, *, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, overlap: str = "none",
                 transport: str = "p2p", chunks: int | None = None, save_gathered_input: bool = False,
                 hardware: str = "h200-sxm", name: str = "", device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, group, bias=bias, sequence_parallel=sequence_parallel,
                         overlap=overlap, name=name, device=device, dtype=dtype, transport=transport,
                         chunks=chunks, save_gathered_input=save_gathered_input, hardware=hardware)
        check_divisible(out_features, self.tp_size, "ColumnParallelLinear: out_features")
        self.gather_output = gather_output
        self.out_per_rank = out_features // self.tp_size
        self._make_params((self.out_per_rank, in_features), (self.out_per_rank,), in_features, bias, device, dtype)

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full weight [out, in] or bias [out] (rows)."""
        return full.chunk(self.tp_size, dim=0)[self.tp_rank]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(self, x, self.in_features, sp_split=False)
        tokens = x.numel() // x.shape[-1] * (self.tp_size if self.sequence_parallel else 1)
        mode, chunks = self._mode(x, tokens, self.in_features, self.out_per_rank, "all_gather", x.shape[0])
        self._maybe_warn(x, mode)
        if mode == "pipelined":
            y = column_parallel_linear_pipelined(x, self.weight, self.bias, self.group, chunks=chunks,
                                                 transport=self.transport, name=self.name or "column",
                                                 save_gathered_input=self.save_gathered_input)
        else:
            y = _ColumnLinear.apply(x, self.weight, self.bias, self.group, self.sequence_parallel,
                                    mode == "bulk", self.name)
        return gather_from_tp(y, self.group, self.name + ".out") if self.gather_output else y


class RowParallelLinear(_ParallelLinear):
    """y = x W^T + b with W split by input columns over the TP group; partial outputs are summed.

    With sequence_parallel the sum is a reduce-scatter over dim 0 (output is this rank's
    tokens), without it an all-reduce. The bias is full and added after the sum; with
    sequence_parallel its gradient covers this rank's tokens only and is marked
    `sequence_parallel` (see allreduce_sequence_parallel_grads).
    """

    def __init__(self, in_features: int, out_features: int, group: dist.ProcessGroup, *, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, overlap: str = "none",
                 transport: str = "p2p", chunks: int | None = None, hardware: str = "h200-sxm",
                 name: str = "", device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, group, bias=bias, sequence_parallel=sequence_parallel,
                         overlap=overlap, name=name, device=device, dtype=dtype, transport=transport,
                         chunks=chunks, hardware=hardware)
        check_divisible(in_features, self.tp_size, "RowParallelLinear: in_features")
        self.input_is_parallel = input_is_parallel
        self.in_per_rank = in_features // self.tp_size
        self._make_params((out_features, self.in_per_rank), (out_features,), in_features, bias, device, dtype)
        if self.bias is not None and sequence_parallel:
            self.bias.sequence_parallel = True

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full weight [out, in] (columns); a bias is not split."""
        return full.chunk(self.tp_size, dim=-1)[self.tp_rank] if full.dim() == 2 else full

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        expected = self.in_per_rank if self.input_is_parallel else self.in_features
        _check_input(self, x, expected, sp_split=self.sequence_parallel)
        mode, chunks = self._mode(x, x.numel() // x.shape[-1], self.in_per_rank, self.out_features,
                                  "reduce_scatter", x.shape[0] // self.tp_size)
        self._maybe_warn(x, mode)
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group, self.name + ".in")
        if mode == "pipelined":
            return row_parallel_linear_pipelined(x, self.weight, self.bias, self.group, chunks=chunks,
                                                 transport=self.transport, name=self.name or "row")
        return _RowLinear.apply(x, self.weight, self.bias, self.group, self.sequence_parallel, self.name)


def allreduce_sequence_parallel_grads(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Sum over the TP group the grads of parameters that live in the sequence-parallel region.

    Layer norms and the row-parallel bias see only this rank's tokens under sequence
    parallelism, so each rank holds a partial gradient. Call after backward, before the
    optimizer step (and before or after data-parallel reduction: sums commute). One flat
    all-reduce for all of them.
    """
    if getattr(module, "sums_sequence_parallel_grads", False):
        raise ValueError("allreduce_sequence_parallel_grads: this DataParallel already sums sequence-parallel "
                         "gradients over its sequence_parallel_group in backward; a second sum would double them")
    grads = [p.grad for p in module.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if comm.group_size(group) > 1:
        comm.all_reduce_coalesced(grads, group, kind="tp_all_reduce", name="sequence_parallel_grads")
