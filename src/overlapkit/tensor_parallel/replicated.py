"""Replicated parameters (norms, biases outside the TP layers) as DTensors that compute on their local tensors.

Nothing here overlaps anything. After a plan, the TP layers' parameters are DTensors sharded on
the TP mesh; everything else would stay a plain tensor, and torch's whole-model loops —
`clip_grad_norm_`, `get_total_norm`, foreach/fused optimizers, EMA — refuse a list mixing the
two ("got mixed torch.Tensor and DTensor"). As torchtitan does, every other parameter becomes a
DTensor `Replicate()` on the same mesh, so those loops see one kind and DTensor computes a
replicated parameter's norm once (not once per rank).

The module's own forward does not see the DTensor: a forward pre-hook puts a local view of each
DTensor parameter in its place (autograd returns the gradient as a DTensor of the parameter's
spec, see params.py) and a forward hook puts the parameter back, so a norm computes on plain
tensors with no DTensor dispatch on its path. `sum_over` adds, for modules that see only part
of the data (a norm on this rank's slice of the sequence, a norm over this rank's heads), an
all-reduce of the gradient over the TP group inside autograd (Megatron's f: identity forward,
all-reduce backward), so `.grad` is complete when backward returns and FSDP2, which replaces
the Parameter objects, still gets the summed gradient (the hook finds whatever tensors the
module holds at each forward). Under torch.compile the sum is a gradient hook on the parameter
instead (the recorder around the all-reduce cannot be traced), run eagerly before the gradient
is accumulated, so `.grad` is complete all the same.
"""

from __future__ import annotations

import torch
from torch import nn

from ..runtime import comm
from .mappings import copy_to_tp
from .params import LocalShardParams, grad_as_param, is_dtensor, param_parts

_HOOKS = "_overlapkit_replicated_hooks"
"""Module attribute: (handles, TP group or None for no gradient sum) once the hooks are installed."""


def _replicate(p: nn.Parameter, mesh) -> nn.Parameter:
    from torch.distributed.tensor import DTensor, Replicate

    new = nn.Parameter(DTensor.from_local(p.data, mesh, [Replicate()], run_check=False),
                       requires_grad=p.requires_grad)
    new.__dict__.update(p.__dict__)  # markers such as `sequence_parallel`
    new.__dict__.pop(SUMMED_BY_HOOK, None)  # p's gradient hook is p's own
    return new


def _check_replicated(module: nn.Module, mesh, label: str) -> None:
    from torch.distributed.tensor import Replicate

    for name, p in module._parameters.items():
        if p is not None and is_dtensor(p) and (tuple(p.placements) != (Replicate(),) or p.device_mesh != mesh):
            raise ValueError(f"{label}: parameter {name!r} is a DTensor {tuple(p.placements)} on {p.device_mesh}; a "
                             f"replicated module's parameters must be plain or Replicate() on {mesh}")


def replicate_module(module: nn.Module, mesh, group, *, sum_over=None, label: str = "",
                     done: dict | None = None) -> nn.Module:
    """Make `module`'s own plain parameters DTensors `Replicate()` on `mesh`, computed on local views.

    `sum_over`: a TP group whose sum each gradient of this module's parameters gets in backward
    (the module sees part of the data), or None. `done` maps id(old parameter) -> new one, so a
    parameter shared by several modules stays one. `mesh=None` (one process, or a group without a
    mesh) keeps plain parameters; the gradient sum still applies. Idempotent.
    """
    label = label or type(module).__name__
    if mesh is not None:
        _check_replicated(module, mesh, label)
        done = {} if done is None else done
        for name, p in list(module._parameters.items()):
            if p is None or is_dtensor(p):
                continue
            if id(p) not in done:
                done[id(p)] = _replicate(p, mesh)
            module._parameters[name] = done[id(p)]
    if getattr(module, _HOOKS, None) is None:
        handles = (module.register_forward_pre_hook(_local_views),
                   module.register_forward_hook(_restore, always_call=True),
                   module._register_load_state_dict_pre_hook(_load_hook, with_module=True))
        # the last item: the stack of parameters a forward swapped for local views (an attribute made here,
        # not in the hook: torch 2.11's dynamo cannot trace `module.__dict__.setdefault`)
        object.__setattr__(module, _HOOKS, [handles, sum_over, f"sequence_parallel_grads.{label}", []])
    elif sum_over is not None:
        getattr(module, _HOOKS)[1] = sum_over
    if sum_over is not None:
        # The sum as a gradient hook on each parameter now, not at the first compiled forward: a
        # hook registered while dynamo traces changes what the graph was traced with, and the
        # second step recompiles the whole model. A parameter that replaces it later (FSDP2's)
        # is summed by the forward's view instead (_local_views).
        for p in module._parameters.values():
            if p is not None and p.requires_grad and not getattr(p, SUMMED_BY_HOOK, False):
                p.register_hook(_sum_over_tp(sum_over, getattr(module, _HOOKS)[2]))
                setattr(p, SUMMED_BY_HOOK, True)
    return module


def sums_gradients(module: nn.Module) -> bool:
    """Whether `replicate_module(..., sum_over=group)` made this module's gradients sums over TP."""
    state = getattr(module, _HOOKS, None)
    return state is not None and state[1] is not None


def replicate_parameters(model: nn.Module, mesh, group) -> nn.Module:
    """Every plain parameter of `model` outside the TP layers becomes a DTensor `Replicate()` on `mesh`.

    Parameters shared by several modules stay one parameter. Expert weights (marked
    `expert_parallel`) keep their plain local tensors: they are split over the EP ranks (and over
    TP inside the experts), not replicated on the TP mesh, and a Replicate() spec would misstate
    them (a norm over them would count one rank's experts as everyone's). Returns `model`.
    """
    done: dict = {}
    for name, module in model.named_modules():
        own = [p for p in module._parameters.values() if p is not None]
        if isinstance(module, LocalShardParams) or own and all(getattr(p, "expert_parallel", False) for p in own):
            continue
        if any(p is not None and not is_dtensor(p) for p in module._parameters.values()) or sums_gradients(module):
            replicate_module(module, mesh, group, label=name, done=done,
                             sum_over=getattr(module, _HOOKS, [None, None])[1])
    return model


def _local_views(module: nn.Module, _args) -> None:
    _, group, name, stack = getattr(module, _HOOKS)
    saved = {}
    compiling = torch.compiler.is_compiling()
    for pname, p in module._parameters.items():
        if p is None or not (is_dtensor(p) or group is not None and p.requires_grad):
            continue
        saved[pname] = p
        view = LocalShardParams.local(p) if p.requires_grad and torch.is_grad_enabled() else _local_data(p)
        if group is not None and view.requires_grad:
            if compiling:
                # The recorder around the all-reduce cannot be traced: under torch.compile the sum
                # is a gradient hook on the parameter itself, run eagerly before accumulation
                # (registered by replicate_module; here for a parameter that replaced that one).
                if not getattr(p, SUMMED_BY_HOOK, False):
                    p.register_hook(_sum_over_tp(group, name))
                    setattr(p, SUMMED_BY_HOOK, True)
            elif not getattr(p, SUMMED_BY_HOOK, False):
                view = copy_to_tp(view, group, name)  # partial gradients summed over TP in backward
        module._parameters[pname] = view
    stack.append(saved)


SUMMED_BY_HOOK = "_overlapkit_sp_grad_hook"
"""Set on a parameter whose gradient hook sums it over TP (it then needs no sum in its view); a copy of
the parameter that does not carry the hook must not carry this mark either."""


def _sum_over_tp(group, name: str):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        spec, local = param_parts(grad)
        local = local.contiguous().clone()
        comm.all_reduce(local, group, kind="tp_all_reduce", name=name, async_op=False)
        return local if spec is None else grad_as_param(local, spec, local)
    return hook


def _restore(module: nn.Module, _args, _out) -> None:
    stack = getattr(module, _HOOKS)[3]
    if stack:
        module._parameters.update(stack.pop())


def _local_data(p: torch.Tensor) -> torch.Tensor:
    return p._local_tensor if is_dtensor(p) else p


def _load_hook(module, state_dict, prefix, *_):
    # A full plain tensor (an HF checkpoint, a plain model's state_dict) into a Replicate()
    # parameter: every rank holds it whole, so it is the local tensor as it is.
    from torch.distributed.tensor import DTensor

    for name, p in module._parameters.items():
        key = prefix + name
        if p is not None and is_dtensor(p) and key in state_dict and not is_dtensor(state_dict[key]):
            value = state_dict[key]
            if tuple(value.shape) != tuple(p.shape):
                continue  # nn.Module's own check names the mismatch
            state_dict[key] = DTensor.from_local(value.to(p.dtype), p.device_mesh, p.placements, run_check=False)
