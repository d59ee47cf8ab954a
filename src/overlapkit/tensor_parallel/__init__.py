"""Tensor and sequence parallelism: conjugate ops, parallel linear layers, pipelined AG+GEMM / GEMM+RS."""

from .layers import ColumnParallelLinear, RowParallelLinear, allreduce_sequence_parallel_grads
from .mappings import (copy_to_tp, gather_from_sp, gather_from_tp, reduce_from_tp, reduce_scatter_to_sp,
                       scatter_to_sp, scatter_to_tp)

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "allreduce_sequence_parallel_grads",
    "copy_to_tp", "reduce_from_tp", "scatter_to_sp", "gather_from_sp", "reduce_scatter_to_sp",
    "gather_from_tp", "scatter_to_tp",
]
