"""The tensor-parallel linears as torch.library custom ops, so torch.compile keeps their overlap in one graph.

Dynamo cannot trace an async collective, a P2POp or a CUDA event, and broke the graph at each one;
an opaque custom op with a fake (meta) kernel for its shapes, under an autograd.Function dynamo
traces, is one node of a `fullgraph=True` graph, and its body (linear_bodies.py, timeline spans
included) runs at execution time. Two ops per kind: `overlapkit::<kind>_fwd(x, w, b, ...) -> (y,
extra)` and `overlapkit::<kind>_bwd(dy, x, extra, w, ...) -> (dx, dw, db)`; docs/tensor_parallel_pipelined.md
has the details (absent results, the group by name, the cross-rank check of each new signature).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime import state
from ..runtime.agreement import agree
from .linear_bodies import KINDS, backward, forward

_ARGS = "str group, bool sp, bool bulk, int k, str transport, bool save_gathered, str name"
"""Static arguments shared by every op (unused ones are ignored by a kind)."""


def group_by_name(name: str):
    """The process group of `group.group_name`, as torch's functional collectives resolve it."""
    return dist.distributed_c10d._resolve_process_group(name)


_seen: set = state.cache_set("tp.custom_op_checks")
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
    ws = dist.get_world_size(group_by_name(group))
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
        pg = group_by_name(group)
        _agree_once(kind, x, w, b, pg, group, sp, bulk, k, transport, save_gathered, name)
        y, extra = forward(kind, x, w, b, pg, sp, bulk, k, transport, save_gathered, name)
        if extra is None:
            return y, x.new_empty(0)
        if extra.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
            extra = extra.clone()  # one rank: the "gathered" input is x; an op's output may not alias its input
        return y, extra

    def bwd(dy, x, extra, w, has_bias, need_dx, group, sp, bulk, k, transport, save_gathered, name):
        dx, dw, db = backward(kind, dy, x, extra, w, has_bias, need_dx, group_by_name(group), sp, bulk, k, transport,
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


def compiled(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, args: tuple) -> torch.Tensor:
    """The linear as its custom op, for torch.compile: w, b plain local shards; args as in _EagerLinear."""
    kind, group, *rest = args
    return _CompiledLinear.apply(x, w, b, kind, (group.group_name, *rest))
