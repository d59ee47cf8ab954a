"""Expert parallelism: a MoE layer whose dispatch and combine all-to-alls hide behind other token chunks' expert GEMMs."""

from .config import MoEConfig
from .dispatch import DispatchPlan, ExpertsA2A, chunk_bounds, plan_dispatch
from .experts import Experts, init_full_experts
from .grads import average_data_parallel_grads, clip_grad_norm_
from .moe import LoadStats, MoE
from .routed import DispatchCombine
from .router import Router, Routing, load_balancing_loss

__all__ = ["MoE", "MoEConfig", "LoadStats", "Router", "Routing", "load_balancing_loss", "Experts",
           "init_full_experts", "average_data_parallel_grads", "clip_grad_norm_", "DispatchCombine", "DispatchPlan", "ExpertsA2A", "plan_dispatch", "chunk_bounds"]
