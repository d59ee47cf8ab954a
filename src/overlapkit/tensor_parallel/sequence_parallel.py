"""Gradients of parameters inside the sequence-parallel region, summed over TP during backward.

Nothing here overlaps anything (each sum is a small synchronous all-reduce in backward).
Under sequence parallelism a layer norm sees only its rank's tokens, so its weight gradient
is a partial sum. `mark_sequence_parallel(norm, tp)` makes the norm's parameters' gradients
complete inside autograd: a gradient hook sums them over the TP group before they are
accumulated. Whatever consumes `.grad` afterwards — an optimizer, our DataParallel, FSDP2's
reduce-scatter over dp — sees the full gradient, and nobody has to remember a call after
backward.

Why a hook attached in a forward pre-hook, not one on the Parameter at marking time: FSDP2
(`fully_shard`), `to_empty` and `load_state_dict(assign=True)` replace Parameter objects (and
drop Python attributes such as `.sequence_parallel`); the module object stays. Before each
forward the pre-hook finds the tensors the norm is about to use — under FSDP2 the unsharded
parameters — and hooks any it has not hooked yet.

The row-parallel bias needs none of this: the layer computes its gradient from the
all-gathered output gradient, complete on every rank.

`allreduce_sequence_parallel_grads` is the older, manual path for parameters marked
`param.sequence_parallel = True` by hand (Megatron's convention); it is kept for them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..groups import resolve_group
from .params import is_dtensor

_HOOKED = "_overlapkit_sp_grad_hook"
"""Attribute set on a tensor whose gradient hook is in place (so it is hooked once)."""


def _sum_over_tp(group, name: str):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, group, kind="tp_all_reduce", name=name, async_op=False)
        return grad
    return hook


def mark_sequence_parallel(module: nn.Module, mesh_or_group, *, name: str = "") -> nn.Module:
    """Make the gradients of `module`'s parameters sums over the TP group; returns `module`.

    For modules that run inside the sequence-parallel region on this rank's tokens (layer
    norms, RMS norms). Idempotent. DTensor parameters are refused: their own Partial →
    Replicate semantics already sum them (torch's SequenceParallel style).
    """
    group = resolve_group(mesh_or_group, "tp")
    label = name or type(module).__name__
    for pname, p in module.named_parameters():
        if is_dtensor(p):
            raise ValueError(f"mark_sequence_parallel({label}): parameter {pname!r} is a DTensor; its placements "
                             "already decide how its gradient is reduced")
    if comm.group_size(group) == 1 or getattr(module, _HOOKED, None) is not None:
        return module
    hook = _sum_over_tp(group, f"sequence_parallel_grads.{label}")

    def pre_forward(mod, args):
        for p in mod.parameters():
            if p.requires_grad and not getattr(p, _HOOKED, False):
                p.register_hook(hook)
                setattr(p, _HOOKED, True)

    setattr(module, _HOOKED, module.register_forward_pre_hook(pre_forward))
    return module


def is_marked_sequence_parallel(module: nn.Module) -> bool:
    """Whether `mark_sequence_parallel` was applied to `module`."""
    return getattr(module, _HOOKED, None) is not None


def allreduce_sequence_parallel_grads(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Sum over the TP group the grads of parameters marked `param.sequence_parallel = True` by hand.

    The manual path (Megatron's convention). overlapkit's layers and `mark_sequence_parallel`
    no longer need it: their gradients are complete after backward, and they carry no marker,
    so this sums nothing for them. Call after backward, before the optimizer step. One flat
    all-reduce for all of them.
    """
    if getattr(module, "sums_sequence_parallel_grads", False):
        raise ValueError("allreduce_sequence_parallel_grads: this DataParallel already sums sequence-parallel "
                         "gradients over its sequence_parallel_group in backward; a second sum would double them")
    grads = [p.grad for p in module.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if comm.group_size(group) > 1:
        comm.all_reduce_coalesced(grads, group, kind="tp_all_reduce", name="sequence_parallel_grads")
