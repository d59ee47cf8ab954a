"""The aten ops a call dispatches: a host-cost proxy that needs no GPU. In eager PyTorch each op is a
trip through the dispatcher and, unless it only makes a view, a kernel launch on a GPU — what a
host-bound layer spends its time on. Used by ep_overlap, ep_host_cost and the MoE op-count test."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
METADATA = {aten.view.default, aten._unsafe_view.default, aten.t.default, aten.transpose.int, aten.select.int,
            aten.slice.Tensor, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default, aten.expand.default,
            aten.detach.default, aten.alias.default, aten.as_strided.default, aten.permute.default,
            aten.empty.memory_format, aten.new_empty.default, aten.empty_like.default, aten.empty_strided.default}
"""Ops that launch no kernel: views and allocations (still a dispatch each)."""


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn) -> tuple[object, Counter]:
    """(fn()'s result, {aten op: times dispatched while fn ran}), the autograd engine's ops included."""
    mode = _Count()
    with mode:
        out = fn()
    return out, mode.ops


def summary(ops: Counter) -> dict:
    """{ops: all dispatched, kernels: those that are not a view or an allocation}."""
    total = sum(ops.values())
    return dict(ops=total, kernels=total - sum(n for f, n in ops.items() if f in METADATA))


def layer_ops(layer, x: torch.Tensor, dy: torch.Tensor) -> dict:
    """Op counts of one forward (no grad), one forward with grad and its backward of `layer` on `x`
    (warmed up first: first-call agreement and probes are not the steady state)."""
    xg = x.detach().requires_grad_()
    layer(xg).backward(dy)
    layer.zero_grad(set_to_none=True)  # as a training step starts: no gradient to accumulate into
    xg = x.detach().requires_grad_()
    with torch.no_grad():
        fwd = summary(count_ops(lambda: layer(x))[1])
    out, grad_fwd = count_ops(lambda: layer(xg))
    _, bwd = count_ops(lambda: out.backward(dy))
    layer.zero_grad(set_to_none=True)
    return dict(fwd=fwd, fwd_grad=summary(grad_fwd), bwd=summary(bwd))
