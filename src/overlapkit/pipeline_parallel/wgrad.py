"""The backward of a chunk split in two: B computes the input gradient (what the previous stage waits
for) and leaves the weight-gradient GEMMs, which nothing waits for until the optimizer, to a later
W action — run where the pipeline would otherwise idle, and under whose GEMMs the data-parallel
reduction of the gradients they complete can run.

Which GEMMs are deferred: those of every `nn.Linear` of the chunk (a forward run under
`split_linears` routes their F.linear through `_SplitLinear`, whose backward keeps dy and x), and
those of overlapkit's tensor-parallel linears (tensor_parallel.ops.defer_weight_grads; the GEMM of
a symm_mem column layer fused with its re-gather stays in B). Every other gradient (biases, norms,
embeddings, experts) is computed in B as usual. A weight used elsewhere too (tied) still gets that
other use's gradient in B: only the linear's own GEMM moves.

W sums a parameter's deferred GEMMs and hands the sums to autograd as the gradients of the
parameters themselves (`emit`), so that accumulation, post-accumulate hooks and DataParallel's
bucket reductions happen exactly as in an ordinary backward.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..tensor_parallel.ops import defer_weight_grads
from ..runtime.recorder import compute_span


class WeightGradStore:
    """The weight-gradient GEMMs one micro-batch's B left for its W, with their inputs."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self._items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, Callable | None]] = []
        self.extra: dict[torch.Tensor, torch.Tensor] = {}
        """Other gradients B computed but did not accumulate (the last micro-batch of a data-parallel chunk)."""

    def add(self, param: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, as_grad: Callable | None = None) -> None:
        """Keep dW = dy^T x for `param` (dy [rows, out], x [rows, in]); `as_grad` turns it into the
        parameter's gradient type (a DTensor of its spec for a tensor-parallel weight)."""
        self._items.append((param, dy, x, as_grad))

    def __len__(self) -> int:
        return len(self._items) + len(self.extra)

    @property
    def nbytes(self) -> int:
        """Bytes this store keeps alive: the GEMMs' inputs (each distinct storage once) and held gradients."""
        seen, total = set(), 0
        for t in [t for _, dy, x, _ in self._items for t in (dy, x)] + list(self.extra.values()):
            t = t.to_local() if hasattr(t, "to_local") else t  # a held gradient of a tensor-parallel parameter
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
        return total

    def gradients(self) -> list[tuple[torch.Tensor, Callable[[], torch.Tensor]]]:
        """(parameter, thunk computing its gradient), in the order the parameters were first used."""
        by_param: dict[torch.Tensor, list] = {}
        for item in self._items:
            by_param.setdefault(item[0], []).append(item)
        for p in self.extra:
            by_param.setdefault(p, [])
        out = []
        for p, items in by_param.items():
            def thunk(items=items, held=self.extra.get(p)):
                with compute_span(f"{self.name}.wgrad"):
                    g = None
                    for _, dy, x, _ in items:
                        g = dy.t() @ x if g is None else g.addmm_(dy.t(), x)
                    if items and items[0][3] is not None:
                        g = items[0][3](g)
                    return held if g is None else (g if held is None else g + held)
            out.append((p, thunk))
        return out

    def clear(self) -> None:
        self._items, self.extra = [], {}


class _Emit(torch.autograd.Function):
    """A root whose backward hands `thunk()` to `param` as its gradient (a node feeding AccumulateGrad)."""

    @staticmethod
    def forward(ctx, param, thunk):
        ctx.thunk = thunk
        return torch.empty(0, device=param.device)

    @staticmethod
    def backward(ctx, _):
        return ctx.thunk(), None


def emit(store: WeightGradStore) -> None:
    """Run W: the store's GEMMs, each parameter's sum accumulated through autograd (one graph task).

    The roots are made in first-use order, so autograd runs the last-made (the chunk's last layers)
    first: the order an ordinary backward completes gradients in, and the order of DataParallel's buckets.
    """
    grads = store.gradients()
    store.clear()
    if grads:
        roots = [_Emit.apply(p, thunk) for p, thunk in grads]
        torch.autograd.backward(roots, [torch.empty(0, device=r.device) for r in roots])


class _SplitLinear(torch.autograd.Function):
    """y = x W^T + b whose backward computes dx and db and leaves dW = dy^T x to `store`.

    Under autocast the GEMM runs in the autocast dtype, as nn.Linear's would; the cast operands are
    what backward uses, so it needs no autocast of its own (a pair's backward runs on another thread)."""

    @staticmethod
    def forward(ctx, x, w, b, store):
        dt = x.device.type
        ctx.param = w
        if dt in ("cpu", "cuda") and torch.is_autocast_enabled(dt):
            cdt = torch.get_autocast_dtype(dt)
            x, w, b = (t.to(cdt) if t is not None and t.dtype != cdt else t for t in (x, w, b))
        ctx.save_for_backward(x, w)
        ctx.store, ctx.has_bias = store, b is not None
        with torch.autocast(dt, enabled=False) if dt in ("cpu", "cuda") else contextlib.nullcontext():
            return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = dy @ w if ctx.needs_input_grad[0] else None
        dy2 = dy.reshape(-1, dy.shape[-1])
        db = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if ctx.needs_input_grad[1]:
            ctx.store.add(ctx.param, dy2, x.reshape(-1, x.shape[-1]))
        return dx, None, db, None


class _RouteLinears(TorchFunctionMode):
    """Routes F.linear calls on the given weights through _SplitLinear (when grad is enabled)."""

    def __init__(self, weights: set, store: WeightGradStore) -> None:
        super().__init__()
        self.weights, self.store = weights, store

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            x, w = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            if w in self.weights:
                b = args[2] if len(args) > 2 else kwargs.get("bias")
                return _SplitLinear.apply(x, w, b, self.store)
        return func(*args, **kwargs)


def linear_weights(modules: Iterable[nn.Module]) -> set:
    """The weights whose GEMMs a split backward defers: of every plain nn.Linear (not DTensor ones)."""
    out = set()
    for module in modules:
        for m in module.modules():
            if isinstance(m, nn.Linear) and m.weight.requires_grad and not hasattr(m.weight, "device_mesh"):
                out.add(m.weight)
    return out


class split_linears:
    """Context for a chunk's forward whose backward will be split: nn.Linear weights in `weights` and
    overlapkit's tensor-parallel linears leave their weight-gradient GEMMs to `store`."""

    def __init__(self, weights: set, store: WeightGradStore) -> None:
        self._mode = _RouteLinears(weights, store) if weights else None
        self._tp = defer_weight_grads(store)

    def __enter__(self):
        self._tp.__enter__()
        if self._mode is not None:
            self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        if self._mode is not None:
            self._mode.__exit__(*exc)
        return self._tp.__exit__(*exc)
