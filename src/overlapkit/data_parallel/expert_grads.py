"""The gradients of experts split over ep, inside a DataParallel: each expert's reduced over the ranks that hold a copy of it, no more, each experts module's all-reduce overlapping the backward of the layers before it.

An expert parameter (a transformers model's experts, `Shard(0)` DTensors on their "ep" mesh) is
held by one rank of each EP group; the EP groups are consecutive runs of the data-parallel group
(`overlapkit.init(ep=..)`), so the copies of a rank's experts are the ranks at the same EP position
of the other runs: the expert-data group `runtime.groups.expert_data_group_of` gives. The combine's
backward already brought every token of the EP group to the expert's gradient; summed over the
copies and divided by the data-parallel size it is the gradient of the mean loss, as the dense
parameters' average over dp is. Averaging experts over dp like dense parameters would mix different
experts: a silently wrong result. An experts module's gradients are complete when its (routed) backward
has run: their all-reduce is issued then, asynchronously, and waited for at the end of backward.
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
        self.units: list[list[nn.Parameter]] = []
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
        units: dict[str, list] = {}
        for name, p in named:
            units.setdefault(name.rpartition(".")[0], []).append(p)
        self.units = list(units.values())
        """The parameters of each experts module, reduced together once all have their gradient."""
        for u, params in enumerate(self.units):
            for i, p in enumerate(params):
                p.register_post_accumulate_grad_hook(lambda _p, u=u, i=i: self._on_grad(u, i))

    def copy_from_first(self) -> None:
        """Every copy of an expert starts as the first copy's (as DataParallel does for dense parameters)."""
        if self.group is not None and self.params:
            from .agree import copy_from_first_rank

            with torch.no_grad():
                copy_from_first_rank([local(p) for p in self.params], self.group)

    def begin_backward(self, sync: bool) -> None:
        """Called by the first hook of a backward: reduce during it and finish when it ends (not under no_sync:
        the gradients accumulate, and the next synced backward reduces their sum)."""
        if self._queued or not sync or not self.params:
            return
        self._queued = True
        self._ready = [set() for _ in self.units]
        self._flights: dict[int, tuple] = {}
        torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def _on_grad(self, unit: int, i: int) -> None:
        # An experts module's gradients are complete once each of its parameters has accumulated: its
        # all-reduce then runs while the earlier layers' backward computes. The copies run the same graph,
        # so they issue the modules in the same order.
        if not self._queued or unit in self._flights:
            return
        self._ready[unit].add(i)
        if len(self._ready[unit]) == len(self.units[unit]):
            self._launch(unit)

    def _launch(self, unit: int) -> None:
        params = self.units[unit]
        for p in params:
            if p.grad is None:  # a module whose experts no token reached on this rank
                p.grad = torch.zeros_like(p)
        grads = [local(p.grad) for p in params]
        flat = handle = None
        if self.group is not None:
            flat = torch.cat([g.detach().reshape(-1) for g in grads])
            handle = comm.all_reduce(flat, self.group, kind="dp_all_reduce", name=f"expert_grads[{unit}]")
        self._flights[unit] = (grads, flat, handle)

    def finish(self) -> None:
        """At the end of backward: every module's sum over the copies waited for, divided by the dp size."""
        for unit in range(len(self.units)):
            if unit not in self._flights:
                self._launch(unit)
        with torch.no_grad():
            for unit in range(len(self.units)):
                grads, flat, handle = self._flights[unit]
                if handle is not None:
                    handle.wait()
                    offset = 0
                    for g in grads:
                        g.copy_(flat[offset:offset + g.numel()].view_as(g))
                        offset += g.numel()
                for g in grads:
                    g.div_(self.dp)
        self._queued, self._flights = False, {}

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
