"""Data-parallel gradient averaging and clipping for a model whose experts are carved out of DP; it overlaps nothing.

Dense parameters (attention, router, norms) are replicated over DP: their gradients are
averaged over the DP group, as DataParallel does. Expert parameters are held by one EP rank
each: their gradients already hold the contributions of every token of their EP group (the
combine's backward brought them there), so they are summed only over the ranks that hold a copy
of the same experts (one per EP group: none when ep == dp) and divided by the DP size to match
the mean loss. Averaging them over DP like dense ones would mix different experts: a silently
wrong result.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ..runtime import comm
from ..runtime.entry import check_device


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard, in place


def average_data_parallel_grads(model: nn.Module, dp_group, ep_group) -> None:
    """Average `model`'s gradients over DP, treating `expert_parallel` parameters as above.

    With ep < dp the copies of a rank's experts live on the ranks of the other EP groups at the same
    EP position: each rank puts its expert gradients in the slot of its EP position of an
    [ep, ...] buffer, zeros elsewhere, and one all-reduce over DP sums every slot over exactly its
    copies (zeros add exactly; no extra process group to create).
    """
    dp, ep = comm.group_size(dp_group), comm.group_size(ep_group)
    if ep > dp or dp % ep:
        raise ValueError(f"average_data_parallel_grads: ep={ep} must divide dp={dp} (EP groups are carved out of DP)")
    dense, experts = [], []
    for p in model.parameters():
        if p.grad is not None:
            (experts if getattr(p, "expert_parallel", False) and ep > 1 else dense).append(_local(p.grad))
    if dp > 1:
        comm.all_reduce_coalesced(dense, dp_group, kind="dp_all_reduce", name="dense_grads")
    if experts and dp > ep:
        flat = torch.cat([g.reshape(-1) for g in experts])
        slots = flat.new_zeros((ep, flat.numel()))
        slots[comm.group_rank(ep_group)] = flat
        comm.all_reduce_coalesced([slots], dp_group, kind="dp_all_reduce", name="expert_grads")
        flat = slots[comm.group_rank(ep_group)]
        off = 0
        for g in experts:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()
    for g in dense + experts:
        g.div_(dp)


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, group=None) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for parameters that live on several meshes (dense ones on the TP
    mesh, experts `Shard(0)` on the EP mesh), which torch's refuses (it stacks their norms): each mesh's
    norm made whole first, then one total norm and one coefficient for all. `group`: the pipeline's group,
    whose ranks each hold other parameters (their stages): the norms are combined over it, so every stage
    clips by the whole model's norm. Returns the total norm."""
    params = [p for p in parameters if p.grad is not None]
    by_mesh: dict = {}
    for p in params:
        by_mesh.setdefault(id(getattr(p.grad, "device_mesh", None)), []).append(p.grad)
    norms = []
    for grads in by_mesh.values():
        n = torch.nn.utils.get_total_norm(grads, norm_type)
        norms.append(n.full_tensor() if hasattr(n, "full_tensor") else n)
    if group is None and not norms:
        return torch.tensor(0.0)
    device = params[0].grad.device if params else check_device(group)  # NCCL needs the GPU
    total = torch.nn.utils.get_total_norm(norms, norm_type) if norms else torch.zeros((), device=device)
    if group is not None:  # a stage with no gradients still joins the collective
        total = _over_group(total.float().to(device), norm_type, group)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    by_device: dict = {}  # one multi-tensor kernel per device, as torch's clip does (not a launch per gradient)
    for p in params:
        g = _local(p.grad)
        by_device.setdefault(g.device, []).append(g)
    for device, grads in by_device.items():
        torch._foreach_mul_(grads, coef.to(device))
    return total


def _over_group(norm: torch.Tensor, norm_type: float, group) -> torch.Tensor:
    """The norm of the parameters of every rank of `group`, from each rank's own norm."""
    if math.isinf(norm_type):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    powered = norm.pow(norm_type)
    dist.all_reduce(powered, group=group)
    return powered.pow(1.0 / norm_type)
