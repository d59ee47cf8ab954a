"""The plan's edges: replicated parameters used between a column and a row layer get their gradient summed over TP, or are refused.

Nothing here overlaps anything. Between a column layer (its output: this rank's features or
heads) and the row layer that sums them, every tensor holds one rank's part of the activation.
A replicated parameter used there (an activation's learnable `alpha`, a norm over each head)
sees only that part, so each rank's gradient of it is a partial sum, and its copies drift apart
under the optimizer with nothing said. Which parameters those are is read from the model's own
forward, not from a list of families: the first forward with gradients on is preceded by one
traced forward under `no_grad` (same inputs, the RNG state restored) in which every column
layer's output is marked "sharded", the mark follows every op that reads a marked tensor, and
the row layers clear it. Then, per module with replicated parameters:

- used only with sharded tensors (each rank's part of the activation, disjoint across ranks):
  the gradient is the sum of the ranks' parts, so it is summed over TP inside autograd, as the
  norms of the sequence-parallel region are (`replicate_module(sum_over=...)`);
- used with sharded tensors and whole ones alike: no single rule is right; refused, naming it;
- an op that fails on a sharded tensor and a whole parameter (a parameter per channel of the
  sharded dim, e.g. a per-head norm weight [heads, head_dim]): refused, naming it (its channels
  would have to be split with the column layer's; pass plan= or untie the dims);
- a replicated parameter read outside its own module's forward (a mixer handing
  `self.conv1d.weight` to a kernel) reaches that op as a DTensor: refused, naming it.

The refusals are ValueErrors raised on every rank alike before any gradient exists.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..tensor_parallel.params import LocalShardParams, is_dtensor
from ..tensor_parallel.replicated import replicate_module, sums_gradients

_KIND = "_overlapkit_tp_kind"
"""Attribute on a traced activation: "sharded" (this rank's part of a column layer's output, or
computed from one) or "whole" (computed from the model's inputs, or a row layer's output)."""
_FROM = "_overlapkit_from_params"
"""Attribute on a traced tensor computed from replicated parameters alone: their names."""
_HOOK = "_overlapkit_edge_hook"


def _replicated_params(model: nn.Module) -> dict[int, tuple[torch.Tensor, str, str]]:
    """id(tensor a module computes with) -> (tensor, module path, parameter name), for every
    parameter outside the TP layers whose gradient is not already summed over TP."""
    out = {}
    for path, module in model.named_modules():
        if isinstance(module, LocalShardParams) or sums_gradients(module):
            continue
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            for t in (p, p._local_tensor if is_dtensor(p) else None):
                if t is not None:
                    out[id(t)] = (t, path, name)
    return out


class _Trace(TorchFunctionMode):
    """Follows the "sharded" mark through every op and notes how each replicated parameter is used."""

    def __init__(self, params: dict) -> None:
        super().__init__()
        self.params = params
        self.uses: dict[tuple[str, str], set[str]] = {}  # (module, param) -> {"sharded", "whole"}
        self.modules: list[str] = []  # the modules whose forward is running, innermost last

    def enter(self, path: str, module: nn.Module, _args) -> None:
        """A module's forward starts: note it, and the tensors it now computes with in place of its
        parameters (the local views the replicated modules' hooks put there, and under FSDP2 the
        unsharded ones, neither of which exists before the forward)."""
        self.modules.append(path or type(module).__name__)
        if isinstance(module, LocalShardParams) or sums_gradients(module):
            return
        for name, t in module._parameters.items():
            if isinstance(t, torch.Tensor):  # under no_grad a view's requires_grad says nothing
                self.params[id(t)] = (t, path, name)

    def _names(self, t: torch.Tensor) -> set:
        hit = self.params.get(id(t))
        if hit is not None and hit[0] is t:
            return {(hit[1], hit[2])}
        return getattr(t, _FROM, set())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        kinds = {getattr(t, _KIND, None) for t in tensors}
        sharded, whole = "sharded" in kinds, "whole" in kinds
        params: set = set()
        for t in tensors:
            params |= self._names(t)
        try:
            out = func(*args, **kwargs)
        except RuntimeError as e:
            self._refuse(func, e, tensors, sharded, params)
            raise
        for key in params:
            if sharded or whole:
                self.uses.setdefault(key, set()).add("sharded" if sharded else "whole")
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            if is_dtensor(t):
                if params and not (sharded or whole):
                    setattr(t, _FROM, params)  # a view of a replicated DTensor, still the parameter
                continue
            if sharded or whole:
                setattr(t, _KIND, "sharded" if sharded else "whole")
            elif params:
                setattr(t, _FROM, params)  # e.g. Gemma's (1 + weight): still the parameter
        return out

    def _refuse(self, func, error: RuntimeError, tensors: list, sharded: bool, params: set) -> None:
        """A ValueError naming the parameters an op failed on, where they are the reason."""
        what = f"{getattr(func, '__name__', func)} ({str(error).splitlines()[0][:160]})"
        whole = sorted(f"{m}.{p}" for t in tensors if is_dtensor(t) for m, p in self._names(t))
        if whole:  # only a module's own forward sees its parameters' local tensors
            raise ValueError(f"parallelize: {', '.join(whole)} is read outside its module's forward, as a replicated "
                             f"DTensor, by {what}; this module cannot run under tensor parallelism as it is: leave "
                             "it out of the plan's reach (plan=, docs/plans.md) or run the model without TP") from None
        if sharded and params:
            names = ", ".join(sorted(f"{m}.{p}" for m, p in params))
            raise ValueError(f"parallelize: {names} meets this rank's part of a column layer's output in {what}: a "
                             "parameter per channel of the split dim would have to be split with it; pass plan= "
                             "(docs/plans.md)") from None
        if sharded and self.modules:
            raise ValueError(f"parallelize: {self.modules[-1]} computes {what} on this rank's part of a column "
                             "layer's output and a tensor the plan does not split (a mask or state per head, made "
                             "outside the split layers); pass plan= (docs/plans.md)") from None


def _mark(kind: str, module, _args, out):
    if isinstance(out, torch.Tensor) and not is_dtensor(out):
        setattr(out, _KIND, "whole" if getattr(module, "gather_output", False) else kind)


def trace_edges(model: nn.Module, args: tuple, kwargs: dict) -> dict[tuple[str, str], set[str]]:
    """Run `model(*args, **kwargs)` once under no_grad (RNG restored) and return how each replicated
    parameter was used: (module path, name) -> {"sharded", "whole"}; ValueError naming refusals."""
    handles = []
    trace = _Trace(_replicated_params(model))
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear) and module.tp_size > 1:
            handles.append(module.register_forward_hook(functools.partial(_mark, "sharded")))
        elif isinstance(module, RowParallelLinear):
            handles.append(module.register_forward_hook(functools.partial(_mark, "whole")))
    for path, module in model.named_modules():  # which module an op ran in, for the refusals
        handles.append(module.register_forward_pre_hook(functools.partial(trace.enter, path)))
        handles.append(module.register_forward_hook(lambda *_: trace.modules.pop() and None, always_call=True))
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad(), trace:
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor):
                    setattr(t, _KIND, "whole")
            model(*args, **kwargs)
    finally:
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                t.__dict__.pop(_KIND, None)
        for h in handles:
            h.remove()
    return trace.uses


def apply_edges(model: nn.Module, uses: dict, group) -> list[str]:
    """Sum over TP the gradients of modules whose parameters met only sharded tensors; refuse the
    ones that met both. Returns the module paths whose gradients are now summed."""
    by_module: dict[str, set] = {}
    for (path, name), how in uses.items():
        by_module.setdefault(path, set()).update(how)
    mixed = sorted(path for path, how in by_module.items() if how == {"sharded", "whole"})
    if mixed:
        names = sorted(f"{p}.{n}" for p, n in uses if p in mixed)
        raise ValueError(f"parallelize: {', '.join(names)} meet both this rank's part of a column layer's output "
                         "and whole tensors, so their gradient is neither complete nor a sum of parts; pass plan= "
                         "(docs/plans.md)")
    summed = sorted(path for path, how in by_module.items() if how == {"sharded"})
    for path in summed:
        # mesh=None: the parameters are DTensors already (Replicate() on TP, or FSDP2's on (dp, tp));
        # only the gradient sum is added to the hooks parallelize installed.
        replicate_module(model.get_submodule(path), None, group, sum_over=group, label=path)
    return summed


def watch_edges(model: nn.Module, group, example: dict | None = None) -> None:
    """Trace a forward and apply `apply_edges` (see above): now on `example` (keyword inputs) when
    given, so refusals come from `parallelize` itself; else before the first forward with
    gradients on, on its own inputs."""
    if example is not None:
        try:
            model.plan_edges_summed = apply_edges(model, trace_edges(model, (), example), group)
            return
        except (RuntimeError, NotImplementedError):
            pass  # e.g. parameters on the meta device: the first forward decides

    @torch.compiler.disable  # the trace runs eagerly, also when the first call is a compiled one
    def first_forward(module, args, kwargs):
        if not torch.is_grad_enabled():
            return None
        getattr(module, _HOOK).remove()
        object.__setattr__(module, _HOOK, None)
        module.plan_edges_summed = apply_edges(module, trace_edges(module, args, kwargs), group)
        return None

    # prepend: the traced forward runs before the model's other pre-hooks, which then set their
    # per-forward state (the sequence region's) for the real forward, not the traced one.
    object.__setattr__(model, _HOOK, model.register_forward_pre_hook(first_forward, with_kwargs=True, prepend=True))
