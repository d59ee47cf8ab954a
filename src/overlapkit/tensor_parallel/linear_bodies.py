"""The bodies of the tensor-parallel linears: forward and backward of each kind on local shards, in eager code.

"column"/"row" are the none and bulk paths (bulk: the column backward's re-gather under the dgrad
GEMM, the dgrad reduce-scatter under the wgrad GEMM); "column_pipelined"/"row_pipelined" the
chunked all-gather+GEMM and GEMM+reduce-scatter of `chunks`, forward and backward (except the
column backward over p2p, which is bulk's: two collectives under two whole GEMMs). `ops` runs them
in an autograd.Function, `custom_ops` inside torch.library ops for torch.compile.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from ..runtime import comm
from . import p2p, symm_mem
from .chunks import ag_mm, lane_stream, mm_rs, regather_wgrad, rows, single, span
from .collectives import gather_dim0, reduce_scatter_dim0

KINDS = ("column", "row", "column_pipelined", "row_pipelined")
"""The linears: none/bulk column and row, and the pipelined pair."""

TRANSPORT_MODULES = {"p2p": p2p, "symm_mem": symm_mem}
"""A pipelined kind's `transport` name -> the module that moves its chunks."""


def forward(kind, x, w, b, group, sp, bulk, k, transport, save_gathered, name):
    """(y, extra) of one linear; extra is the gathered input when column_pipelined saves it."""
    extra = None
    if kind == "column":
        total = gather_dim0(x, group, name + ".fwd") if sp else x
        with span(name + ".fwd.gemm"):
            y = torch.nn.functional.linear(total, w, b)
    elif kind == "row":
        with span(name + ".fwd.gemm"):
            partial = torch.nn.functional.linear(x, w)
        if comm.group_size(group) == 1:
            y = partial
        elif sp:
            y = reduce_scatter_dim0(partial, group, name + ".fwd")
        else:
            y = partial.contiguous()
            comm.all_reduce(y, group, kind="tp_all_reduce", name=name + ".fwd", async_op=False)
        y = y + b if b is not None else y
    elif kind == "column_pipelined":
        ws = comm.group_size(group)
        extra, (y,) = ag_mm(rows(x), [w], k, group, TRANSPORT_MODULES[transport], need_gathered=save_gathered,
                             name=name + ".fwd")
        if b is not None:
            y.add_(b)
        y = y.view(ws * x.shape[0], *x.shape[1:-1], w.shape[0])
    else:
        ws = comm.group_size(group)
        y = mm_rs(rows(x), w.t(), k, group, TRANSPORT_MODULES[transport], name=name + ".fwd")
        if b is not None:
            y.add_(b)
        y = y.view(x.shape[0] // ws, *x.shape[1:-1], w.shape[0])
    return y, extra


wgrad_sink = contextvars.ContextVar("overlapkit_wgrad_sink", default=None)
"""Set while an eager linear's forward runs under defer_weight_grads: where its backward leaves dW."""
deferring = contextvars.ContextVar("overlapkit_wgrad_deferring", default=False)
"""True inside the backward of such a linear: _wgrad hands back its operands instead of the GEMM."""


@contextlib.contextmanager
def defer_weight_grads(sink):
    """Linears whose eager forward runs inside leave their weight-gradient GEMM to their backward's
    caller: `sink.add(weight, dy2, x2, as_grad)` with dW = dy2^T x2 (as_grad makes it the weight's
    gradient type); the backward returns no weight gradient (a pipeline's split B / W). The GEMM a
    symm_mem column layer fuses with its input's re-gather, and compiled layers, are not deferred."""
    token = wgrad_sink.set(sink)
    try:
        yield
    finally:
        wgrad_sink.reset(token)


class DeferredWgrad:
    """The operands of a weight-gradient GEMM left for later (see defer_weight_grads)."""

    __slots__ = ("dy2", "x2")

    def __init__(self, dy2, x2):
        self.dy2, self.x2 = dy2, x2


def _wgrad(dy2, x2, name):
    if deferring.get():
        return DeferredWgrad(dy2, x2)
    with span(name):
        return dy2.t() @ x2


def _flat(t: torch.Tensor) -> torch.Tensor:
    """[rows, features] view of a [*lead, features] tensor (itself when already 2-D)."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def _column_bwd(dy, x, w, group, sp, bulk, need_dx, name, gathered=None):
    """(dx, dw); `gathered` is the full input when the forward kept it (no re-gather then)."""
    ws = comm.group_size(group)
    regather = None
    if gathered is not None:
        total = gathered
    elif sp and ws > 1:
        # Megatron keeps only the input shard; the full input for wgrad is re-gathered now,
        # under the dgrad GEMM (bulk: asynchronously).
        total = x.new_empty((ws * x.shape[0],) + tuple(x.shape[1:]))
        regather = comm.all_gather(total, x.contiguous(), group, kind="tp_all_gather", name=name + ".bwd",
                                   async_op=bulk)
    else:
        total = x
    dx_full = None
    if need_dx:  # the same on every rank (requires_grad is part of the agreed signature)
        with span(name + ".bwd.dgrad"):
            dx_full = dy @ w
    if regather is not None:
        regather.wait()
    reduce = None
    if ws == 1 or dx_full is None:
        dx = dx_full
    elif sp:
        dx = dx_full.new_empty((dx_full.shape[0] // ws,) + tuple(dx_full.shape[1:]))
        reduce = comm.reduce_scatter(dx, dx_full, group, kind="tp_reduce_scatter", name=name + ".bwd",
                                     async_op=bulk)
    else:
        dx = dx_full
        reduce = comm.all_reduce(dx, group, kind="tp_all_reduce", name=name + ".bwd", async_op=bulk)
    dw = _wgrad(_flat(dy), _flat(total), name + ".bwd.wgrad")
    if reduce is not None:
        reduce.wait()
    return dx, dw


def _row_bwd(dy, x, w, group, sp, need_dx, name):
    dy_full = gather_dim0(dy, group, name + ".bwd") if sp else dy
    dx = None
    if need_dx:
        with span(name + ".bwd.dgrad"):
            dx = dy_full @ w
    flat = _flat(dy_full)
    return dx, _wgrad(flat, _flat(x), name + ".bwd.wgrad"), flat


def _row_pipelined_bwd(dy2, x2, w, group, k, transport, need_dx, name):
    if single(k, group):  # one rank, one chunk: the gather is dy2 itself
        dx2 = None
        if need_dx:
            with span(name + ".bwd.dgrad.gemm"):
                dx2 = dy2 @ w
        return dx2, _wgrad(dy2, x2, name + ".bwd.wgrad.gemm"), dy2
    dx2 = x2.new_empty(x2.shape) if need_dx else None

    def consume(rows: slice, data: torch.Tensor, lane: int) -> None:
        if need_dx:
            with span(name + ".bwd.dgrad.gemm", stream=lane_stream(lane)):
                torch.mm(data, w, out=dx2[rows])

    gathered = TRANSPORT_MODULES[transport].gather_and_consume(dy2, consume, k, group, name=name + ".bwd",
                                                          need_gathered=True)
    return dx2, _wgrad(gathered, x2, name + ".bwd.wgrad.gemm"), gathered


def bulk_column_backward(kind: str, transport: str) -> bool:
    """Whether a pipelined kind's backward is bulk's instead (a column layer over p2p: see _bwd)."""
    return kind == "column_pipelined" and transport == "p2p"


def backward(kind, dy, x, extra, w, has_bias, need_dx, group, sp, bulk, k, transport, save_gathered, name):
    """(dx or None, dw, db or None). The bias gradient of a row layer comes from the gathered
    output gradient: complete on every rank, with no sum over TP left for anyone to forget."""
    dy = dy.contiguous()
    if kind == "column":
        dx, dw = _column_bwd(dy, x, w, group, sp, bulk, need_dx, name)
        flat = _flat(dy)
    elif kind == "row":
        dx, dw, flat = _row_bwd(dy, x, w, group, sp, need_dx, name)
    elif bulk_column_backward(kind, transport):
        # Megatron's order for a column backward (TransformerEngine's bulk dgrad/wgrad overlaps):
        # the input's re-gather under the whole dgrad GEMM, the dgrad's reduce-scatter under the
        # whole wgrad GEMM. Both collectives have a full GEMM to hide under, as the chunked
        # pair below has, without splitting either GEMM (on the H200 at TP=8 shapes the graphed x8
        # layer went from 1.18-1.23x to 1.05-1.07x none with it). On CPU, where chunked GEMMs lose
        # little, the chunked pair was faster with data moving (tp_overlap_cpu16_column_bwd_ab.md).
        dx, dw = _column_bwd(dy, x, w, group, True, True, need_dx, name, gathered=extra if save_gathered else None)
        flat = _flat(dy)
    elif kind == "column_pipelined":
        # symm_mem: the transfers are copy-engine pulls that take no SMs from the GEMMs, so
        # both stay pipelined chunk by chunk on that transport.
        flat = rows(dy)
        dx = None
        if need_dx:
            dx = mm_rs(flat, w, k, group, TRANSPORT_MODULES[transport], name=name + ".bwd.dgrad").view(x.shape)
        if save_gathered:
            dw = _wgrad(flat, extra, name + ".bwd.wgrad.gemm")
        else:
            dw = regather_wgrad(rows(x), flat, k, group, TRANSPORT_MODULES[transport], name=name + ".bwd.wgrad")
    else:
        dx2, dw, flat = _row_pipelined_bwd(rows(dy), rows(x), w, group, k, transport, need_dx, name)
        dx = dx2.view(x.shape) if need_dx else None
    return (dx if need_dx else None), dw, (flat.sum(0) if has_bias else None)
