"""`linear(kind, ...)`: the entry point of the tensor-parallel layers into their overlapped bodies.

Under torch.compile it calls the custom ops (custom_ops.py); in eager it runs the same bodies
(linear_bodies.py) through an autograd.Function, which skips the dispatcher's custom-op overhead
(host time per call is what pipelining at TP=8 cannot spare).
"""

from __future__ import annotations

import torch

from .custom_ops import compiled
from .linear_bodies import (KINDS, DeferredWgrad, backward, bulk_column_backward,  # noqa: F401 (re-exported)
                            deferring, defer_weight_grads, forward, wgrad_sink)
from .params import grad_as_param, param_parts


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
        y, extra = forward(kind, x, wl, bl, *rest)
        ctx.save_for_backward(x, wl, extra)
        ctx.args, ctx.wgrad_sink = args, wgrad_sink.get()
        ctx.w = w if ctx.wgrad_sink is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, wl, extra = ctx.saved_tensors
        kind, group, *rest = ctx.args
        token = deferring.set(ctx.wgrad_sink is not None)
        try:
            dx, dw, db = backward(kind, dy, x, extra, wl, ctx.b_parts[1] is not None, ctx.needs_input_grad[0], group,
                              *rest)
        finally:
            deferring.reset(token)
        if isinstance(dw, DeferredWgrad):
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
        return forward(kind, x, _local(w, param_parts(w), cdt), _local(b, param_parts(b), cdt), *rest)[0]
    return _EagerLinear.apply(x, w, b, cdt, args)


def linear(kind: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, group, *, sp: bool = False,
           bulk: bool = False, k: int = 1, transport: str = "p2p", save_gathered: bool = False,
           name: str = "") -> torch.Tensor:
    """One tensor-parallel linear of `kind` (see KINDS), differentiable, compilable with fullgraph=True.

    x is [rows, ..., in] with the sequence-parallel dim first; w, b this rank's shards (nn.Linear
    layout); k the chunks per rank of a pipelined kind. The caller has checked the arguments.
    """
    args = (kind, group, sp, bulk, k, transport, save_gathered, name)
    return compiled(x, w, b, args) if torch.compiler.is_compiling() else eager(x, w, b, None, args)
