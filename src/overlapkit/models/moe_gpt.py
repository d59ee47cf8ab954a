"""The tiny GPT with MoE blocks, built twice alike: EP carved from DP (x TP without SP) and its one-process twin.

What the demo trains and checks; nothing here overlaps anything itself (the MoE blocks do).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from ..expert_parallel import MoE
from ..expert_parallel.config import overlap_of_chunks
from ..runtime.groups import ParallelGroups
from .gpt import GPT, GPTConfig
from .parallelize import expected_local, parallelize


def solo_group():
    """A group of this rank alone (every rank creates every one, in the same order): the reference's EP group."""
    mine = None
    for r in range(dist.get_world_size()):
        group = dist.new_group([r])
        mine = group if r == dist.get_rank() else mine
    return mine


def moe_gpts(cfg: GPTConfig, groups: ParallelGroups, seed: int, *, experts_per_rank: int = 2, top_k: int = 2,
             chunks: int = 2, device=None, **parallelize_kwargs) -> tuple[GPT, GPT]:
    """(reference, model): the same GPT with a MoE in every second block, once on this rank alone and once
    with its experts over `groups.ep` (carved from DP), split over `groups.tp` inside each expert, and the
    dense layers tensor-parallel without sequence parallelism. Collective."""
    ep = groups.sizes.ep
    solo = solo_group()

    def build(moe_group, tp_group):
        torch.manual_seed(seed)  # both draw the same weights, in the same order
        return GPT(cfg, moe_every=2, moe=lambda i: MoE(
            cfg.hidden, cfg.ffn_hidden, experts_per_rank * ep, top_k, moe_group, tp_group=tp_group,
            **overlap_of_chunks(chunks), name=f"blocks.{i}.moe")).to(device)
    reference = build(solo, None)
    model = build(groups, groups.tp if groups.sizes.tp > 1 else None)
    if groups.sizes.tp > 1:
        with warnings.catch_warnings():  # torch notes the plan's mlp.fc1/fc2 are absent in MoE blocks: they are
            warnings.filterwarnings("ignore", message="Parallelize plan key")
            parallelize(model, groups, sequence_parallel=False, **parallelize_kwargs)
    return reference, model


def expected_local_ep(model, reference, what: str = "grad"):
    """`models.expected_local`, with each MoE's expert tensors cut to this rank's experts (and TP slice)."""
    moes = {name: m for name, m in model.named_modules() if isinstance(m, MoE)}
    for name, local, full in expected_local(model, reference, what):
        owner = next((m for prefix, m in moes.items() if name.startswith(prefix + ".experts.")), None)
        if owner is not None and full is not None:
            full = owner.shard_of(full, name.rsplit(".", 1)[1])
        yield name, local, full


def moe_loads(model) -> list[tuple[str, list[int], int]]:
    """(layer name, rows per local expert, dropped) of each MoE's last forward on this rank."""
    return [(m.name, m.last_load.received_per_expert, m.last_load.dropped)
            for m in model.modules() if isinstance(m, MoE) and m.last_load is not None]
