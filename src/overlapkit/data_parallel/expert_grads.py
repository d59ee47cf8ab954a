"""The gradients of experts split over ep, inside a DataParallel: each expert's reduced over the ranks that hold a copy of it, no more; it overlaps nothing (one coalesced all-reduce after backward).

An expert parameter (a transformers model's experts, `Shard(0)` DTensors on their "ep" mesh) is
held by one rank of each EP group; the EP groups are consecutive runs of the data-parallel group
(`overlapkit.init(ep=..)`), so the copies of a rank's experts are the ranks at the same EP position
of the other runs: the expert-data group `runtime.groups.expert_data_group_of` gives. The combine's
backward already brought every token of the EP group to the expert's gradient; summed over the
copies and divided by the data-parallel size it is the gradient of the mean loss, as the dense
parameters' average over dp is. Averaging experts over dp like dense parameters would mix different
experts: a silently wrong result.
"""

from __future__ import annotations

import torch
from torch import nn

from ..runtime import comm
from ..runtime.groups import expert_data_group_of
from .buckets import local


def expert_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every trainable parameter held by one EP rank (`expert_parallel`)."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad and getattr(p, "expert_parallel", False)]


def _ranks(group) -> set[int]:
    import torch.distributed as dist

    return set(dist.get_process_group_ranks(group)) if group is not None else {0}


def _ep_group(p: torch.Tensor):
    mesh = getattr(p, "device_mesh", None)
    return None if mesh is None or mesh.mesh_dim_names != ("ep",) else mesh.get_group()


class ExpertGrads:
    """Sums `named` expert parameters' gradients over their copies and divides them by the dp size.

    ValueError naming a parameter whose EP group `overlapkit.init` did not build (overlapkit's own MoE
    layer keeps plain tensors: `expert_parallel.average_data_parallel_grads` is its path), or whose EP
    group and copies do not tile the data-parallel `group` DataParallel was given.
    """

    def __init__(self, named: list[tuple[str, nn.Parameter]], group) -> None:
        self.params = [p for _, p in named]
        self.dp = comm.group_size(group)
        self.group = None
        self._queued = False
        if not named:
            return
        ep_groups = {id(g): g for g in (_ep_group(p) for _, p in named)}
        first = named[0][0]
        if len(ep_groups) != 1 or None in ep_groups.values():
            raise ValueError(f"DataParallel: expert-parallel parameter {first!r} is not a DTensor on the 'ep' mesh of "
                             "overlapkit.parallelize (overlapkit's own MoE layer keeps plain tensors): use "
                             "overlapkit.expert_parallel.average_data_parallel_grads for it")
        ep_group = next(iter(ep_groups.values()))
        known, self.group = expert_data_group_of(ep_group)
        ep, copies = comm.group_size(ep_group), comm.group_size(self.group) if self.group is not None else 1
        if not known or ep * copies != self.dp or not _ranks(ep_group) <= _ranks(group):
            raise ValueError(f"DataParallel: the experts ({first!r}) are split over an expert-parallel group of {ep} "
                             f"ranks with {copies} copies each, which does not tile the data-parallel group of "
                             f"{self.dp} it was given; pass the dp group of the overlapkit.init(ep=..) that "
                             "parallelize's mesh came from")

    def copy_from_first(self) -> None:
        """Every copy of an expert starts as the first copy's (as DataParallel does for dense parameters)."""
        if self.group is not None and self.params:
            from .agree import copy_from_first_rank

            with torch.no_grad():
                copy_from_first_rank([local(p) for p in self.params], self.group)

    def begin_backward(self, sync: bool) -> None:
        """Called by the first hook of a backward: reduce when it ends (not under no_sync: the gradients
        accumulate, and the next synced backward reduces their sum)."""
        if self._queued or not sync or not self.params:
            return
        self._queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self.reduce)

    def reduce(self) -> None:
        """After backward: sum over the copies, divide by the dp size. A gradient no token reached is zeros."""
        grads = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(local(p.grad))
        if self.group is not None and grads:
            comm.all_reduce_coalesced(grads, self.group, kind="dp_all_reduce", name="expert_grads")
        for g in grads:
            g.div_(self.dp)
        self._queued = False

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
