"""Gradients of parameters inside the sequence-parallel region, summed over TP during backward.

Nothing here overlaps anything (each sum is a small synchronous all-reduce in backward). Under
sequence parallelism a norm sees only its rank's tokens, so its weight gradient is partial:
`mark_sequence_parallel(norm, mesh)` makes its parameters `Replicate()` DTensors whose gradients
are complete inside autograd, through hooks on the module (FSDP2 and `load_state_dict(assign=True)`
replace Parameter objects, the module stays). `allreduce_sequence_parallel_grads` is the manual
path for parameters marked `param.sequence_parallel = True` (Megatron's convention).
docs/tensor_parallel.md has the details.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ..runtime import comm
from .params import mesh_and_group
from .replicated import replicate_module, sums_gradients


def mark_sequence_parallel(module: nn.Module, mesh_or_group, *, name: str = "") -> nn.Module:
    """Make the gradients of `module`'s parameters sums over the TP group; returns `module`.

    For modules that run on part of the data on each TP rank (layer norms inside the
    sequence-parallel region, a norm over this rank's heads). Its own parameters become
    DTensors `Replicate()` on the TP mesh (plain tensors when `mesh_or_group` is a bare group in
    a world without a mesh); DTensors with other placements are refused. Idempotent.
    """
    mesh, group = mesh_and_group(mesh_or_group)
    label = name or type(module).__name__
    if comm.group_size(group) == 1:
        return module
    for sub_name, sub in module.named_modules():
        replicate_module(sub, mesh, group, sum_over=group, label=f"{label}.{sub_name}" if sub_name else label)
    return module


def is_marked_sequence_parallel(module: nn.Module) -> bool:
    """Whether `mark_sequence_parallel` was applied to `module`."""
    return sums_gradients(module)


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
