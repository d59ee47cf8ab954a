"""Data-parallel gradient averaging for a model whose experts are carved out of DP; it overlaps nothing.

Dense parameters (attention, router, norms) are replicated over DP: their gradients are
averaged over the DP group, as DataParallel does. Expert parameters are held by one EP rank
each: their gradients already hold the contributions of every DP rank's tokens (the combine's
backward brought them there), so they are only divided by the DP size to match the mean loss.
Averaging them over DP like dense ones would mix different experts: a silently wrong result.
"""

from __future__ import annotations

from torch import nn

from ..runtime import comm


def average_data_parallel_grads(model: nn.Module, dp_group, ep_group) -> None:
    """Average `model`'s gradients over DP, treating `expert_parallel` parameters as above.

    Needs the EP group to be the whole DP group (ep == dp); with ep < dp the experts' copies
    on the other EP groups would need an expert-data-parallel group, which this does not build.
    """
    dp, ep = comm.group_size(dp_group), comm.group_size(ep_group)
    if ep not in (1, dp):
        raise ValueError(f"average_data_parallel_grads: ep={ep} must equal dp={dp} (or be 1): averaging expert "
                         "gradients over the expert-data-parallel group of ep < dp is not implemented")
    dense, experts = [], []
    for p in model.parameters():
        if p.grad is not None:
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # a DTensor's shard, in place
            (experts if getattr(p, "expert_parallel", False) and ep > 1 else dense).append(grad)
    if dp > 1:
        comm.all_reduce_coalesced(dense, dp_group, kind="dp_all_reduce", name="dense_grads")
    for g in dense + experts:
        g.div_(dp)
