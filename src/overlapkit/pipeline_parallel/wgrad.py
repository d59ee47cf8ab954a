"""The backward of a chunk split in two: B computes the input gradient (what the previous stage waits
for) and leaves the weight-gradient GEMMs, which nothing waits for until the optimizer, to a later
W action — run where the pipeline would otherwise idle, and under whose GEMMs the data-parallel
reduction of the gradients they complete can run.

Which GEMMs are deferred: those of every `nn.Linear` of the chunk (a forward run under
`split_linears` runs their GEMM on the weight detached, and a hook on the output's node keeps dy and x), and
those of overlapkit's tensor-parallel linears (tensor_parallel.ops.defer_weight_grads; the GEMM of
a symm_mem column layer fused with its re-gather stays in B). Every other gradient (biases, norms,
embeddings, experts) is computed in B as usual. A weight used elsewhere too (tied) still gets that
other use's gradient in B: only the linear's own GEMM moves.

W sums a parameter's deferred GEMMs and hands the sums to autograd as the gradients of the
parameters themselves (`emit`), so that accumulation, post-accumulate hooks and DataParallel's
bucket reductions happen exactly as in an ordinary backward.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor_parallel.ops import defer_weight_grads
from ..runtime.recorder import compute_span


class WeightGradStore:
    """The weight-gradient GEMMs one micro-batch's B left for its W, with their inputs."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self._items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, Callable | None]] = []
        self.extra: dict[torch.Tensor, torch.Tensor] = {}
        """Other gradients B computed but did not accumulate (the last micro-batch of a data-parallel chunk)."""
        self.kept_bytes = 0
        """`nbytes` as its B left it (what the step's accounting added, and its W takes away)."""

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


_linear_sink = contextvars.ContextVar("overlapkit_pp_linear_sink", default=None)
"""The store of the split forward running in this thread (a pair's other side runs in another)."""


def _hold(store: WeightGradStore, w: torch.Tensor, x: torch.Tensor, grad_outputs: tuple) -> None:
    """The pre-hook on a split linear's output node: its gradient dy and the input x go to the store, for
    dW = dy^T x."""
    dy = grad_outputs[0]
    store.add(w, dy.reshape(-1, dy.shape[-1]), x.detach().reshape(-1, x.shape[-1]))


def _routed_forward(m: nn.Linear) -> Callable:
    """m's forward during a split F. The GEMM is nn.Linear's own, on the weight detached: autograd's native
    backward then computes dx and db and no dW; a pre-hook on the output's node hands dy (with x) to the store.
    Under autocast x is cast first, so that the store keeps the operands the GEMM used (autocast casts the
    weight and bias inside F.linear as for any linear); W needs no autocast of its own."""
    def forward(x):
        store = _linear_sink.get()
        w, b = m.weight, m.bias
        if store is None or not torch.is_grad_enabled() or not (x.requires_grad or (b is not None and b.requires_grad)):
            return F.linear(x, w, b)  # no graph to hook the output of: dW, if wanted, stays in B
        dt = x.device.type
        if dt in ("cpu", "cuda") and torch.is_autocast_enabled(dt) and x.dtype != torch.get_autocast_dtype(dt):
            x = x.to(torch.get_autocast_dtype(dt))
        y = F.linear(x, w.detach(), b)
        # On the output's node, not the tensor: half the host cost of Tensor.register_hook, the same gradient
        # (what reaches the linear's output, whatever an in-place op does to the tensor afterwards).
        y.grad_fn.register_prehook(functools.partial(_hold, store, w, x))
        return y
    return forward


class LinearRouter:
    """The plain nn.Linear modules of a chunk whose weight-gradient GEMMs a split backward defers, and the
    forward each takes while a split F runs.

    The forwards are set on the modules' instances only for the F's duration (`split_linears`), so a split
    F costs a detach and a node pre-hook per linear over nn.Linear's own (its backward stays autograd's
    native one), where a TorchFunctionMode over the forward paid a Python call per torch function of the
    whole chunk and an autograd Function per linear; at any other time (an unsplit F, the shape
    sweep, a copy of the module) the modules are untouched. Weights held as DTensors (tensor-parallel
    linears defer through their own path), subclasses with a forward of their own and modules whose instance
    already carries a forward (a wrapper someone set: what else they compute is theirs) are left to B."""

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self.forwards: dict[nn.Module, Callable] = {}
        for module in modules:
            for m in module.modules():
                if (isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward and m.weight.requires_grad
                        and not hasattr(m.weight, "device_mesh")):
                    self.forwards[m] = _routed_forward(m)


class split_linears:
    """Context for a chunk's forward whose backward will be split: the router's nn.Linear modules and
    overlapkit's tensor-parallel linears leave their weight-gradient GEMMs to `store`."""

    def __init__(self, router: LinearRouter, store: WeightGradStore) -> None:
        self._router, self._store = router, store
        self._tp = defer_weight_grads(store)

    def __enter__(self):
        self._tp.__enter__()
        self._token = _linear_sink.set(self._store)
        self._set = []
        for m, fn in self._router.forwards.items():
            if "forward" not in m.__dict__:  # a forward set on the instance by someone else (a hook) is theirs
                m.__dict__["forward"] = fn  # past nn.Module.__setattr__: an instance attribute, removed at exit
                self._set.append(m)
        return self

    def __exit__(self, *exc):
        for m in self._set:
            m.__dict__.pop("forward", None)
        _linear_sink.reset(self._token)
        return self._tp.__exit__(*exc)
