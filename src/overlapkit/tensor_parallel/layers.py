"""Column- and row-parallel linear layers, with sequence parallelism, whose communication hides behind their GEMMs.

`overlap` is none (synchronous, the reference), bulk (Megatron's: the column backward's re-gather
under the dgrad GEMM and its dgrad reduce-scatter under the wgrad GEMM), pipelined (the
all-gather / reduce-scatter chunked into the GEMMs over `transport`) or auto (the cost model's
choice per input shape). docs/tensor_parallel.md has what each does in each layer, the layout of
the DTensor parameters and the cross-rank checks.
"""

from __future__ import annotations

import math

import torch

from ..vocabulary import OVERLAP_MODES  # noqa: F401 (re-exported)
from .linear_base import OPTIONS, ParallelLinear, check_overlap  # noqa: F401 (re-exported)
from .mappings import check_divisible, gather_from_tp, scatter_to_tp
from .sequence_parallel import allreduce_sequence_parallel_grads, mark_sequence_parallel  # noqa: F401 (re-export)


class ColumnParallelLinear(ParallelLinear):
    """y = x W^T + b with W split by output rows over the TP group; output is this rank's columns.

    With sequence_parallel the input is this rank's slice of `sequence_dim` and
    is all-gathered first; without it the input is replicated and its gradient is all-reduced
    in backward. The weight and bias are DTensors sharded on dim 0 (Shard(0)).

    Args:
        in_features: size of each input row (the last dim of x).
        out_features: size of each output row.
        mesh_or_group: the TP ranks: a 1-D DeviceMesh, a mesh with a "tp" dim, a ParallelGroups or a
            ProcessGroup; None for the default group.
        bias: whether the layer adds a learned bias.
        gather_output: concatenate every rank's output columns (last dim) after the GEMM.
        sequence_parallel: the activation is split over the TP ranks along `sequence_dim` (Megatron's
            SP): gathered before the GEMM (column) or reduce-scattered after it (row).
        sequence_dim: which dim of the activation is the sequence: 0 for [seq, batch, hidden]
            (Megatron, our GPT), 1 for [batch, seq, hidden] (HF, torchtitan).
        overlap: "none", "bulk", "pipelined" (needs sequence_parallel) or "auto" (the default: the cost
            model picks per input shape, as the README's numbers are measured).
        transport: how pipelined moves its chunks: "p2p" (send/recv, NCCL or gloo) or "symm_mem"
            (copy-engine pulls from symmetric memory; one node, CUDA peer access).
        chunks: pipelined only: chunks of the gathered (or scattered) dim, a multiple of the TP size;
            None for one per rank.
        save_gathered_input: pipelined column layer only: keep the input gathered in forward for
            backward's wgrad GEMM instead of gathering it again (memory for time).
        hardware: the cost model's hardware (a preset name, or a file from `overlapkit bench gemm`)
            that overlap="auto" prices the GEMM on.
        name: the layer's name on the timeline and in error messages.
        device: where the parameters are created.
        dtype: the parameters' dtype.
    """

    _split_dim = 0
    _kind = "column"

    def __init__(self, in_features: int, out_features: int, mesh_or_group=None, *, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, sequence_dim: int = 0,
                 overlap: str = "auto", transport: str = "p2p", chunks: int | None = None,
                 save_gathered_input: bool = False, hardware: str = "h200-sxm", name: str = "",
                 device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, mesh_or_group, bias=bias, sequence_parallel=sequence_parallel,
                         sequence_dim=sequence_dim, overlap=overlap, name=name, device=device, dtype=dtype,
                         transport=transport, chunks=chunks, save_gathered_input=save_gathered_input,
                         hardware=hardware, gather_output=gather_output)
        check_divisible(out_features, self.tp_size, "ColumnParallelLinear: out_features")
        self.gather_output = gather_output
        self.out_per_rank = out_features // self.tp_size
        self._expected_in = in_features
        self._make_params(bias, device, dtype)

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full weight [out, in] or bias [out] (rows)."""
        return full.chunk(self.tp_size, dim=0)[self.tp_rank]

    def _gemm(self, shape, sp: bool):
        tokens = math.prod(shape[:-1]) * (self.tp_size if sp else 1)
        return tokens, self.in_features, self.out_per_rank, "all_gather", shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return gather_from_tp(y, self.group, self.name + ".out") if self.gather_output else y


class RowParallelLinear(ParallelLinear):
    """y = x W^T + b with W split by input columns over the TP group; partial outputs are summed.

    With sequence_parallel the sum is a reduce-scatter over `sequence_dim` (output is this
    rank's tokens), without it an all-reduce. The weight is a DTensor sharded on dim 1; the
    bias is full (Replicate), added after the sum, and its gradient is complete on every rank.

    Args:
        in_features: size of each input row (the last dim of x).
        out_features: size of each output row.
        mesh_or_group: the TP ranks: a 1-D DeviceMesh, a mesh with a "tp" dim, a ParallelGroups or a
            ProcessGroup; None for the default group.
        bias: whether the layer adds a learned bias.
        input_is_parallel: the input is already this rank's columns (the output of a column layer);
            False scatters a full input first.
        sequence_parallel: the activation is split over the TP ranks along `sequence_dim` (Megatron's
            SP): gathered before the GEMM (column) or reduce-scattered after it (row).
        sequence_dim: which dim of the activation is the sequence: 0 for [seq, batch, hidden]
            (Megatron, our GPT), 1 for [batch, seq, hidden] (HF, torchtitan).
        overlap: "none", "bulk", "pipelined" (needs sequence_parallel) or "auto" (the default: the cost
            model picks per input shape, as the README's numbers are measured).
        transport: how pipelined moves its chunks: "p2p" (send/recv, NCCL or gloo) or "symm_mem"
            (copy-engine pulls from symmetric memory; one node, CUDA peer access).
        chunks: pipelined only: chunks of the gathered (or scattered) dim, a multiple of the TP size;
            None for one per rank.
        hardware: the cost model's hardware (a preset name, or a file from `overlapkit bench gemm`)
            that overlap="auto" prices the GEMM on.
        name: the layer's name on the timeline and in error messages.
        device: where the parameters are created.
        dtype: the parameters' dtype.
    """

    _split_dim = 1
    _kind = "row"

    def __init__(self, in_features: int, out_features: int, mesh_or_group=None, *, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, sequence_dim: int = 0,
                 overlap: str = "auto", transport: str = "p2p", chunks: int | None = None,
                 hardware: str = "h200-sxm", name: str = "", device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, mesh_or_group, bias=bias, sequence_parallel=sequence_parallel,
                         sequence_dim=sequence_dim, overlap=overlap, name=name, device=device, dtype=dtype,
                         transport=transport, chunks=chunks, hardware=hardware,
                         input_is_parallel=input_is_parallel)
        check_divisible(in_features, self.tp_size, "RowParallelLinear: in_features")
        self.input_is_parallel = input_is_parallel
        self.in_per_rank = in_features // self.tp_size
        self._expected_in = self.in_per_rank if input_is_parallel else in_features
        self._direct = input_is_parallel
        self._make_params(bias, device, dtype)

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full weight [out, in] (columns); a bias is not split."""
        return full.chunk(self.tp_size, dim=-1)[self.tp_rank] if full.dim() == 2 else full

    def _gemm(self, shape, sp: bool):
        return math.prod(shape[:-1]), self.in_per_rank, self.out_features, "reduce_scatter", shape[0] // self.tp_size

    def _linear(self, x, w, b, args: tuple, cdt, compiled) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group, self.name + ".in")
        return super()._linear(x, w, b, args, cdt, compiled)
