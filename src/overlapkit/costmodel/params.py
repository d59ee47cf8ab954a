"""Parameters each rank holds: what its gradients, optimizer state and reductions are sized by.

A pipeline stage holds its layers (and the embedding on the first, the LM head on the last); TP
shards every weight over tp ranks; expert parallelism further divides a mixture of experts' expert
weights over ep ranks, whose gradients are then reduced over the dp/ep ranks holding the same
experts (Megatron's expert-data-parallel group) rather than over all dp.
"""

from __future__ import annotations

from dataclasses import dataclass

from .model import ModelConfig
from .parallel import ParallelConfig


def stage_params(model: ModelConfig, par: ParallelConfig, stage: int | None = None) -> int:
    """Parameters of a pipeline stage (default: the last, with the LM head), before TP and EP sharding."""
    stage = par.pp - 1 if stage is None else stage
    n = par.stage_layers(model.num_layers)[stage] * model.layer_params
    if par.pp == 1:
        return n + model.embedding_params
    table = model.vocab_size * model.hidden
    return n + (table if stage == 0 else 0) + (table if stage == par.pp - 1 else 0)


@dataclass(frozen=True)
class RankParams:
    """Parameters one rank of a pipeline stage holds, after TP and EP sharding."""

    dense: float
    """Attention, dense MLPs, norms, routers, embedding/head shards: replicated over the dp·cp ranks."""
    expert: float
    """Expert weights: replicated over the dp·cp/ep ranks that hold the same experts."""

    @property
    def total(self) -> float:
        return self.dense + self.expert


def rank_params(model: ModelConfig, par: ParallelConfig, stage: int | None = None) -> RankParams:
    """Dense and expert parameters on one rank of `stage` (default: the last)."""
    stage = par.pp - 1 if stage is None else stage
    expert = par.stage_layers(model.num_layers)[stage] * model.expert_layer_params
    dense = stage_params(model, par, stage) - expert
    return RankParams(dense / par.tp, expert / (par.tp * par.ep))


def shards(par: ParallelConfig) -> tuple[int, int]:
    """(dense, expert) data-parallel replicas: how many ranks share a parameter's gradient and ZeRO shards."""
    dp = par.dp * par.cp
    return dp, max(1, dp // par.ep)
