"""Serving with the communication of tensor parallelism hidden or made minimal: the decode step's fused
all-reduce + residual add + norm (`all_reduce_add_norm`), decode steps captured in CUDA graphs, and each
prefill / decode forward as one step of the timeline with its exposed communication (`exposed_per_step`).

overlapkit.parallelize installs the decode layout on a transformers model (models/hf_decode.py);
docs/inference.md has the layouts and how to measure them.
"""

from .fused import InferenceConfig, all_reduce_add_norm, one_shot_unavailable, reduce_partial
from .graphs import StepGraphs
from .steps import STEP_KINDS, begin_step, end_step, exposed_per_step

__all__ = ["InferenceConfig", "STEP_KINDS", "StepGraphs", "all_reduce_add_norm", "begin_step", "end_step", "exposed_per_step",
           "one_shot_unavailable", "reduce_partial"]
