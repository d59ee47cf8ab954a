"""The tensor-parallel linears as torch.library custom ops, so torch.compile keeps their overlap in one graph.

What overlaps with what is unchanged (see layers.py and pipelined.py): "column"/"row" are the
none and bulk paths (bulk: the column backward's re-gather under the dgrad GEMM, the dgrad
reduce-scatter under the wgrad GEMM), "column_pipelined"/"row_pipelined" the chunked
all-gather+GEMM and GEMM+reduce-scatter, forward and backward (except the column backward over
p2p, which is bulk's: two collectives under two whole GEMMs). Dynamo cannot trace an async
collective, a P2POp or a CUDA event, and broke the graph at each one; an opaque custom op with a
fake (meta) kernel for its shapes, under an autograd.Function dynamo traces, is one node of a
`fullgraph=True` graph, and its body — the same eager code, timeline spans included — runs at
execution time.

Two ops per kind: `overlapkit::<kind>_fwd(x, w, b, ...) -> (y, extra)` and
`overlapkit::<kind>_bwd(dy, x, extra, w, ...) -> (dx, dw, db)`; `extra` is what backward needs
beyond x and w (the gathered input under save_gathered_input), and absent results are empty
tensors (custom ops return no None). The process group travels by name (`group.group_name`) and
is resolved inside, as torch's functional collectives do.

`linear(kind, ...)` is the entry point of the layers: under torch.compile it calls the ops; in
eager it runs the same bodies through an autograd.Function, which skips the dispatcher's
custom-op overhead (host time per call is what pipelining at TP=8 cannot spare).
Under compile the ops compare each new (kind, shape, dtype, options) signature across the
ranks once, as the layers do in eager, before any collective.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.distributed as dist

from ..runtime import comm
from ..runtime.agreement import agree
from . import p2p, symm_mem
from .collectives import gather_dim0, reduce_scatter_dim0
from .params import grad_as_param, param_parts
from .chunks import ag_mm, lane_stream, mm_rs, regather_wgrad, rows, single, span

KINDS = ("column", "row", "column_pipelined", "row_pipelined")
"""The linears registered as ops: none/bulk column and row, and the pipelined pair."""

_TRANSPORTS = {"p2p": p2p, "symm_mem": symm_mem}

_ARGS = "str group, bool sp, bool bulk, int k, str transport, bool save_gathered, str name"
"""Static arguments shared by every op (unused ones are ignored by a kind)."""


def _group(name: str):
    return dist.distributed_c10d._resolve_process_group(name)


# -- the bodies (eager code: collectives, streams, events and timeline spans) ---------------

def _fwd(kind, x, w, b, group, sp, bulk, k, transport, save_gathered, name):
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
        extra, (y,) = ag_mm(rows(x), [w], k, group, _TRANSPORTS[transport], need_gathered=save_gathered,
                             name=name + ".fwd")
        if b is not None:
            y.add_(b)
        y = y.view(ws * x.shape[0], *x.shape[1:-1], w.shape[0])
    else:
        ws = comm.group_size(group)
        y = mm_rs(rows(x), w.t(), k, group, _TRANSPORTS[transport], name=name + ".fwd")
        if b is not None:
            y.add_(b)
        y = y.view(x.shape[0] // ws, *x.shape[1:-1], w.shape[0])
    return y, extra


_wgrad_sink = contextvars.ContextVar("overlapkit_wgrad_sink", default=None)
"""Set while an eager linear's forward runs under defer_weight_grads: where its backward leaves dW."""
_deferring = contextvars.ContextVar("overlapkit_wgrad_deferring", default=False)
"""True inside the backward of such a linear: _wgrad hands back its operands instead of the GEMM."""


@contextlib.contextmanager
def defer_weight_grads(sink):
    """Linears whose eager forward runs inside leave their weight-gradient GEMM to their backward's
    caller: `sink.add(weight, dy2, x2, as_grad)` with dW = dy2^T x2 (as_grad makes it the weight's
    gradient type); the backward returns no weight gradient (a pipeline's split B / W). The GEMM a
    symm_mem column layer fuses with its input's re-gather, and compiled layers, are not deferred."""
    token = _wgrad_sink.set(sink)
    try:
        yield
    finally:
        _wgrad_sink.reset(token)


class _DeferredWgrad:
    """The operands of a weight-gradient GEMM left for later (see defer_weight_grads)."""

    __slots__ = ("dy2", "x2")

    def __init__(self, dy2, x2):
        self.dy2, self.x2 = dy2, x2


def _wgrad(dy2, x2, name):
    if _deferring.get():
        return _DeferredWgrad(dy2, x2)
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

    gathered = _TRANSPORTS[transport].gather_and_consume(dy2, consume, k, group, name=name + ".bwd",
                                                          need_gathered=True)
    return dx2, _wgrad(gathered, x2, name + ".bwd.wgrad.gemm"), gathered


def bulk_column_backward(kind: str, transport: str) -> bool:
    """Whether a pipelined kind's backward is bulk's instead (a column layer over p2p: see _bwd)."""
    return kind == "column_pipelined" and transport == "p2p"


def _bwd(kind, dy, x, extra, w, has_bias, need_dx, group, sp, bulk, k, transport, save_gathered, name):
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
            dx = mm_rs(flat, w, k, group, _TRANSPORTS[transport], name=name + ".bwd.dgrad").view(x.shape)
        if save_gathered:
            dw = _wgrad(flat, extra, name + ".bwd.wgrad.gemm")
        else:
            dw = regather_wgrad(rows(x), flat, k, group, _TRANSPORTS[transport], name=name + ".bwd.wgrad")
    else:
        dx2, dw, flat = _row_pipelined_bwd(rows(dy), rows(x), w, group, k, transport, need_dx, name)
        dx = dx2.view(x.shape) if need_dx else None
    return (dx if need_dx else None), dw, (flat.sum(0) if has_bias else None)


# -- eager: one autograd.Function over the bodies ---------------------------------------------

def _local(p, parts, cdt):
    """p's local shard (parts from param_parts), in the autocast dtype when one is given."""
    if p is None:
        return None
    local = parts[1]
    return local.to(cdt) if cdt is not None and local.dtype != cdt else local


class _EagerLinear(torch.autograd.Function):
    """One linear on the local shards of w and b, which may be the layer's DTensor parameters.

    Taking the parameters themselves (not `to_local()` views) saves two autograd Functions a
    call, and their gradients go back as DTensors of the parameters' specs (grad_as_param).
    `cdt` is the autocast dtype the GEMMs run in (None: the parameters' own); `args` are the
    static arguments of the bodies: (kind, group, sp, bulk, k, transport, save_gathered, name).
    """

    @staticmethod
    def forward(ctx, x, w, b, cdt, args):
        ctx.w_parts, ctx.b_parts = param_parts(w), param_parts(b)
        wl, bl = _local(w, ctx.w_parts, cdt), _local(b, ctx.b_parts, cdt)
        kind, *rest = args
        y, extra = _fwd(kind, x, wl, bl, *rest)
        ctx.save_for_backward(x, wl, extra)
        ctx.args, ctx.wgrad_sink = args, _wgrad_sink.get()
        ctx.w = w if ctx.wgrad_sink is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, wl, extra = ctx.saved_tensors
        kind, group, *rest = ctx.args
        token = _deferring.set(ctx.wgrad_sink is not None)
        try:
            dx, dw, db = _bwd(kind, dy, x, extra, wl, ctx.b_parts[1] is not None, ctx.needs_input_grad[0], group,
                              *rest)
        finally:
            _deferring.reset(token)
        if isinstance(dw, _DeferredWgrad):
            spec, local = ctx.w_parts
            ctx.wgrad_sink.add(ctx.w, dw.dy2, dw.x2, lambda g: grad_as_param(g, spec, local))
            dw = None
        return dx, grad_as_param(dw, *ctx.w_parts), grad_as_param(db, *ctx.b_parts), None, None


def eager(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, cdt, args: tuple) -> torch.Tensor:
    """The eager linear over the layer's parameters (DTensor or plain) w, b; see _EagerLinear."""
    if not torch.is_grad_enabled():
        # Nothing to differentiate (inference, a pipeline's no-grad pass): the forward body on
        # the local shards, without an autograd Function over DTensor inputs (host time only).
        kind, *rest = args
        return _fwd(kind, x, _local(w, param_parts(w), cdt), _local(b, param_parts(b), cdt), *rest)[0]
    return _EagerLinear.apply(x, w, b, cdt, args)


# -- compiled: the custom ops --------------------------------------------------------------

_seen: set = set()
"""Every (kind, name, shape, ...) signature already compared across ranks: a seen call is one
set lookup, without building the label and fields the comparison needs."""


def _agree_once(kind, x, w, b, group, group_name, sp, bulk, k, transport, save_gathered, name):
    key = (kind, name, x.shape, x.dtype, w.shape, b is None, group_name, sp, bulk, k, transport, save_gathered)
    if key in _seen:
        return
    agree(group, f"overlapkit::{kind}({name})", shape=tuple(x.shape), dtype=x.dtype, weight=tuple(w.shape),
          bias=b is not None, group_name=group_name, sp=sp, bulk=bulk, k=k, transport=transport,
          save_gathered=save_gathered)
    _seen.add(key)


def _fake_fwd(kind, x, w, b, group, sp, k, save_gathered):
    ws = dist.get_world_size(_group(group))
    lead = x.shape[0]
    if kind == "column_pipelined" or (kind == "column" and sp):
        lead = ws * lead
    elif kind == "row_pipelined" or (kind == "row" and sp):
        lead = lead // ws
    y = x.new_empty((lead, *x.shape[1:-1], w.shape[0]))
    if kind == "column_pipelined" and save_gathered:
        rows = x.numel() // x.shape[-1]
        return y, x.new_empty((ws * rows, x.shape[-1]))
    return y, x.new_empty(0)


_LIB = torch.library.Library("overlapkit", "DEF")
"""The ops' namespace. Defined through the low-level Library API, with one backend kernel
(CompositeExplicitAutograd) and no autograd kernel: `torch.library.custom_op` wraps every call
in Python autograd and dispatch layers (~10 µs a call on a CPU core, 8 calls a layer step),
which a compiled graph pays at run time. The autograd formula is `_CompiledLinear` instead,
which dynamo traces into the graph, so the compiled forward and backward call the bodies
through the C++ dispatcher alone."""


def _register(kind: str) -> None:
    fwd_name, bwd_name = f"{kind}_fwd", f"{kind}_bwd"

    def fwd(x, w, b, group, sp, bulk, k, transport, save_gathered, name):
        pg = _group(group)
        _agree_once(kind, x, w, b, pg, group, sp, bulk, k, transport, save_gathered, name)
        y, extra = _fwd(kind, x, w, b, pg, sp, bulk, k, transport, save_gathered, name)
        if extra is None:
            return y, x.new_empty(0)
        if extra.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
            extra = extra.clone()  # one rank: the "gathered" input is x; an op's output may not alias its input
        return y, extra

    def bwd(dy, x, extra, w, has_bias, need_dx, group, sp, bulk, k, transport, save_gathered, name):
        dx, dw, db = _bwd(kind, dy, x, extra, w, has_bias, need_dx, _group(group), sp, bulk, k, transport,
                          save_gathered, name)
        return (x.new_empty(0) if dx is None else dx), dw, (w.new_empty(0) if db is None else db)

    _LIB.define(f"{fwd_name}(Tensor x, Tensor w, Tensor? b, {_ARGS}) -> (Tensor, Tensor)")
    _LIB.define(f"{bwd_name}(Tensor dy, Tensor x, Tensor extra, Tensor w, bool has_bias, bool need_dx, "
                f"{_ARGS}) -> (Tensor, Tensor, Tensor)")
    _LIB.impl(fwd_name, fwd, "CompositeExplicitAutograd")
    _LIB.impl(bwd_name, bwd, "CompositeExplicitAutograd")

    @torch.library.register_fake(f"overlapkit::{fwd_name}", lib=_LIB)
    def _(x, w, b, group, sp, bulk, k, transport, save_gathered, name):
        return _fake_fwd(kind, x, w, b, group, sp, k, save_gathered)

    @torch.library.register_fake(f"overlapkit::{bwd_name}", lib=_LIB)
    def _(dy, x, extra, w, has_bias, need_dx, group, sp, bulk, k, transport, save_gathered, name):
        return (x.new_empty(x.shape) if need_dx else x.new_empty(0), w.new_empty(w.shape),
                w.new_empty(w.shape[0]) if has_bias else w.new_empty(0))


class _CompiledLinear(torch.autograd.Function):
    """The ops' autograd: forward the `<kind>_fwd` op, backward the `<kind>_bwd` op (traced by dynamo).

    `static` are the ops' static arguments: (group name, sp, bulk, k, transport, save_gathered, name).
    """

    @staticmethod
    def forward(ctx, x, w, b, kind, static):
        y, extra = getattr(torch.ops.overlapkit, f"{kind}_fwd")(x, w, b, *static)
        ctx.save_for_backward(x, w, extra)
        ctx.kind, ctx.static, ctx.has_bias = kind, static, b is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, extra = ctx.saved_tensors
        need_dx = ctx.needs_input_grad[0]
        dx, dw, db = getattr(torch.ops.overlapkit, f"{ctx.kind}_bwd")(dy, x, extra, w, ctx.has_bias, need_dx,
                                                                      *ctx.static)
        return (dx if need_dx else None), dw, (db if ctx.has_bias else None), None, None


for _kind in KINDS:
    _register(_kind)


def linear(kind: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, group, *, sp: bool = False,
           bulk: bool = False, k: int = 1, transport: str = "p2p", save_gathered: bool = False,
           name: str = "") -> torch.Tensor:
    """One tensor-parallel linear of `kind` (see KINDS), differentiable, compilable with fullgraph=True.

    x is [rows, ..., in] with the sequence-parallel dim first; w, b this rank's shards (nn.Linear
    layout); k the chunks per rank of a pipelined kind. The caller has checked the arguments.
    """
    args = (kind, group, sp, bulk, k, transport, save_gathered, name)
    return compiled(x, w, b, args) if torch.compiler.is_compiling() else eager(x, w, b, None, args)


def compiled(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, args: tuple) -> torch.Tensor:
    """The linear as its custom op, for torch.compile: w, b plain local shards; args as in _EagerLinear."""
    kind, group, *rest = args
    return _CompiledLinear.apply(x, w, b, kind, (group.group_name, *rest))
