"""A batch for context parallelism: each rank's slice of the sequences, and the group its parameters average over.

Nothing here overlaps anything; ring attention (`attention.py`) hides the key/value exchange.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ..runtime.comm import group_rank, group_size
from ..runtime.groups import ParallelGroups, resolve_group
from .split import positions, shard


def shard_batch(tokens: torch.Tensor, mesh_or_group, layout: str = "zigzag"):
    """(this rank's tokens [b, s_local], their global positions [b, s_local]) of `tokens` [b, s]."""
    group = resolve_group(mesh_or_group, "cp")
    size, rank = group_size(group), group_rank(group)
    local = shard(tokens, 1, rank, size, layout)
    pos = positions(tokens.shape[1], rank, size, layout, device=tokens.device)
    return local, pos.unsqueeze(0).expand(tokens.shape[0], -1)


def shard_labels(labels: torch.Tensor, mesh_or_group, layout: str = "zigzag", ignore_index: int = -100):
    """This rank's causal-LM targets [b, s_local] of `labels` [b, s]: each local token's label is the next
    token's of the whole sequence (`ignore_index` for the last), as transformers' `shift_labels=` takes
    them; shifting the local tokens instead would pair tokens that are not neighbours under the zigzag cut."""
    group = resolve_group(mesh_or_group, "cp")
    shifted = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shard(shifted, 1, group_rank(group), group_size(group), layout)


def replicas_group(groups: ParallelGroups, timeout_s: float | None = None) -> dist.ProcessGroup:
    """The ranks holding the same parameters under CP: this rank's dp × cp ranks (gradients average over them).

    Collective: every rank creates every such group, in the same order.
    """
    sizes = groups.sizes
    timeout = datetime.timedelta(seconds=timeout_s if timeout_s is not None else groups.timeout_s)
    mine = None
    for pp in range(sizes.pp):
        for tp in range(sizes.tp):
            ranks = [sizes.rank_of(tp=tp, dp=d, pp=pp, cp=c) for d in range(sizes.dp) for c in range(sizes.cp)]
            group = dist.new_group(ranks, timeout=timeout)
            if groups.rank in ranks:
                mine = group
    return mine
