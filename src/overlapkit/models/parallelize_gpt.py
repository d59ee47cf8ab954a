"""`parallelize_gpt`: the engines composed on the tiny GPT, in torchtitan's order (TP, CP, then data parallel).

Nothing here overlaps anything itself: each engine hides its own communication. This is where the
order is decided — tensor (and sequence) parallel first, ring attention over the CP ranks, then
ZeRO-3 (`fully_shard`) or `DataParallel` over the ranks that hold the same parameters.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ..context_parallel import replicas_group
from ..data_parallel import DataParallel, fully_shard
from ..runtime.groups import ParallelGroups
from .parallelize import parallelize
from .ring_attention import apply_to_gpt


def parallelize_gpt(model: nn.Module, groups: ParallelGroups, *, overlap: str = "auto", zero: int = 0,
                    tensor_parallel: bool = True) -> tuple[nn.Module, dist.ProcessGroup]:
    """(the GPT with every engine of `groups` applied, the group its replicated parameters average over).

    `tensor_parallel=False`: the model is already tensor parallel (a MoE GPT from `moe_gpt.moe_gpts`,
    whose experts are split over EP and so never go under DataParallel). `zero=3` shards the blocks
    over dp with `fully_shard` (prefetch="auto") instead of DataParallel. Collective.
    """
    sizes = groups.sizes
    if tensor_parallel:
        # Sequence parallel under ZeRO-3 too: the norms' TP gradient sums are hooks on the tensors
        # each forward uses (mark_sequence_parallel), so FSDP2's replaced parameters keep them.
        model = parallelize(model, groups.mesh, sequence_parallel=True, overlap=overlap)  # its 'tp' dim
    replicas = groups.dp
    if sizes.cp > 1:  # ring attention over the CP ranks; parameters are replicated over dp x cp
        model, replicas = apply_to_gpt(model, groups.cp), replicas_group(groups)
    if zero == 3:
        model = fully_shard(model, groups, overlap="auto")
    elif (sizes.dp > 1 or sizes.cp > 1) and sizes.ep == 1:
        # Sequence-parallel grads (layer norms, row biases) are summed over TP in backward,
        # bucket by bucket, before their data-parallel all-reduce.
        model = DataParallel(model, replicas, sequence_parallel_group=groups.tp)
    return model, replicas
