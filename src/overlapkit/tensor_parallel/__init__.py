"""Tensor and sequence parallelism: conjugate ops, parallel linear layers with DTensor parameters, pipelined AG+GEMM / GEMM+RS."""

from .layers import ColumnParallelLinear, RowParallelLinear
from .mappings import (copy_to_tp, gather_from_sp, gather_from_tp, reduce_from_tp, reduce_scatter_to_sp,
                       scatter_to_sp, scatter_to_tp)
from .params import LocalShardParams, localize_parameters, tp_mesh, tp_mesh_and_group
from .sequence_parallel import allreduce_sequence_parallel_grads, is_marked_sequence_parallel, mark_sequence_parallel
from .styles import (ColwiseParallel, GatheredInputColumnLinear, GatherSequence, RowwiseParallel, ScatterSequence,
                     SequenceParallel, VocabParallel)
from .vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "allreduce_sequence_parallel_grads",
    "mark_sequence_parallel", "is_marked_sequence_parallel", "localize_parameters", "tp_mesh", "tp_mesh_and_group",
    "LocalShardParams",
    "copy_to_tp", "reduce_from_tp", "scatter_to_sp", "gather_from_sp", "reduce_scatter_to_sp",
    "gather_from_tp", "scatter_to_tp",
    "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "ScatterSequence", "GatherSequence", "VocabParallel",
    "GatheredInputColumnLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
]
