"""Pipelined tensor/sequence parallelism: the all-gather before a GEMM and the reduce-scatter after it, chunked and overlapped with that GEMM.

`all_gather_matmul` computes gather(x) @ Wᵀ chunk by chunk, each chunk's GEMM as soon as it lands;
`matmul_reduce_scatter` computes reduce_scatter(x @ Wᵀ), each chunk's partial sent while the next
is computed. `column_parallel_linear_pipelined` / `row_parallel_linear_pipelined` are the
differentiable linears built on them (bodies in linear_bodies.py, kernels in chunks.py).
docs/tensor_parallel_pipelined.md has the forward and backward orders, the transports and the
chunk counts.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..runtime import comm
from ..vocabulary import TRANSPORTS
from . import ops, p2p, symm_mem
from .chunks import ag_mm, mm_rs, rows
from .precision import autocast_dtype, autocast_off, cast
from .symm_mem import TransportUnavailable


__all__ = ["TRANSPORTS", "TransportUnavailable", "all_gather_matmul", "matmul_reduce_scatter",
           "column_parallel_linear_pipelined", "row_parallel_linear_pipelined", "allowed_chunks",
           "check_layer_options"]


# -- argument checks (local, identical on every rank, before any communication) ------------

def allowed_chunks(ws: int, rows_per_rank: int) -> list[int]:
    """The chunk counts that split every rank's rows evenly: ws times each divisor of the rows."""
    return [ws * d for d in range(1, rows_per_rank + 1) if rows_per_rank % d == 0]


def _chunks_per_rank(chunks, ws: int, rows_per_rank: int, dim: int) -> int:
    if chunks is None:
        return 1
    if (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < ws or chunks % ws
            or rows_per_rank % (chunks // ws)):
        # Listing the allowed values walks every divisor: only worth it when raising (it cost
        # ~0.3 ms a call at 8192 rows, longer than the GEMM it guarded).
        allowed = allowed_chunks(ws, rows_per_rank)
        raise ValueError(
            f"chunks={chunks!r} is not allowed with world size {ws} and {rows_per_rank} rows per rank "
            f"along dim {dim}: allowed are None (one chunk per rank, {ws}) or one of {allowed}")
    return chunks // ws


def check_layer_options(overlap: str, sequence_parallel: bool, transport, chunks, tp_size: int,
                        save_gathered_input: bool = False) -> None:
    """Construction-time checks of a parallel layer's pipelining options (shape-free ones)."""
    if overlap == "auto":
        # auto picks the chunk count per GEMM; the transport is the user's (it depends on the machine).
        if chunks is not None:
            raise ValueError(f"chunks={chunks!r}: overlap='auto' chooses the chunk count itself; "
                             "pass overlap='pipelined' to fix it")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport={transport!r} is not one of {TRANSPORTS}")
        return
    if overlap != "pipelined":
        if transport != "p2p" or chunks is not None or save_gathered_input:
            raise ValueError(f"transport={transport!r}, chunks={chunks!r}, save_gathered_input="
                             f"{save_gathered_input!r} apply to overlap='pipelined' or 'auto' only, "
                             f"not overlap={overlap!r}")
        return
    if not sequence_parallel:
        raise ValueError("overlap='pipelined' chunks the sequence-parallel all-gather/reduce-scatter: "
                         "it needs sequence_parallel=True")
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r} is not one of {TRANSPORTS}")
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int)
                               or chunks < tp_size or chunks % tp_size):
        raise ValueError(f"chunks={chunks!r} must be None (one chunk per rank) or a positive multiple "
                         f"of the tensor-parallel size {tp_size}")


def _check_transport(transport, group, device: torch.device):
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r} is not one of {TRANSPORTS}")
    if transport == "symm_mem":
        symm_mem.check_available(group, device)
        return symm_mem
    return p2p


def _check_dim(x: torch.Tensor, dim: int, what: str) -> int:
    if x.dim() < 2:
        raise ValueError(f"the input must have at least 2 dims [rows, features], got shape {tuple(x.shape)}")
    d = dim + x.dim() if isinstance(dim, int) and dim < 0 else dim
    if not isinstance(d, int) or not 0 <= d <= x.dim() - 2:
        raise ValueError(f"{what}={dim!r} must name a dim of the {x.dim()}-D input other than the last "
                         f"(the GEMM's inner dim): allowed are 0..{x.dim() - 2}")
    return d


def _check_weight(x: torch.Tensor, w: torch.Tensor, what: str) -> None:
    if w.dim() != 2 or w.shape[1] != x.shape[-1]:
        raise ValueError(f"{what} must be [out, {x.shape[-1]}] (nn.Linear layout, in = the input's "
                         f"last dim), got shape {tuple(w.shape)}")
    if w.dtype != x.dtype or w.device != x.device:
        raise ValueError(f"{what} is {w.dtype} on {w.device}, the input {x.dtype} on {x.device}")


def _check_no_grad(*tensors: torch.Tensor) -> None:
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError("all_gather_matmul / matmul_reduce_scatter are not differentiable: use "
                           "column_parallel_linear_pipelined / row_parallel_linear_pipelined for training, "
                           "or call them under torch.no_grad()")


# -- the two pipelines on 2-D row matrices ------------------------------------------------

# -- public forward-only functions --------------------------------------------------------

def all_gather_matmul(x_shard: torch.Tensor, weights: Sequence[torch.Tensor], group, *, gather_dim: int = 0,
                      chunks: int | None = None, transport: str = "p2p", return_gathered: bool = False,
                      name: str = "all_gather_matmul"):
    """[gather(x_shard, gather_dim) @ wᵀ for w in weights], each chunk's GEMM as soon as it lands.

    Several weights share one gather (QKV, gate/up). Returns the list of outputs, or
    (gathered input, outputs) with `return_gathered`. Forward only (not differentiable).
    """
    cdt = autocast_dtype(x_shard)  # under torch.autocast: every GEMM and buffer in its dtype
    x_shard, weights = cast(x_shard, cdt), [cast(w, cdt) for w in weights]
    d = _check_dim(x_shard, gather_dim, "gather_dim")
    if not weights:
        raise ValueError("weights is empty: give at least one [out, in] weight")
    for i, w in enumerate(weights):
        _check_weight(x_shard, w, f"weights[{i}]")
    _check_no_grad(x_shard, *weights)
    ws = comm.group_size(group)
    k = _chunks_per_rank(chunks, ws, x_shard.shape[d], d)
    transport_ = _check_transport(transport, group, x_shard.device)
    xm = x_shard.movedim(d, 0)
    full = (ws * xm.shape[0],) + tuple(xm.shape[1:-1])
    with autocast_off(xm, cdt):
        gathered, outs = ag_mm(rows(xm), weights, k, group, transport_, need_gathered=return_gathered, name=name)
    outs = [o.view(*full, o.shape[-1]).movedim(0, d) for o in outs]
    if return_gathered:
        return gathered.view(*full, xm.shape[-1]).movedim(0, d), outs
    return outs


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group, *, scatter_dim: int = 0,
                          chunks: int | None = None, transport: str = "p2p",
                          name: str = "matmul_reduce_scatter") -> torch.Tensor:
    """reduce_scatter(x @ weightᵀ, scatter_dim): each chunk's partial is sent while the next is computed.

    Partial sums are added in fp32 when x is bf16/fp16. Forward only (not differentiable).
    """
    cdt = autocast_dtype(x)
    x, weight = cast(x, cdt), cast(weight, cdt)
    d = _check_dim(x, scatter_dim, "scatter_dim")
    _check_weight(x, weight, "weight")
    _check_no_grad(x, weight)
    ws = comm.group_size(group)
    if x.shape[d] % ws != 0:
        raise ValueError(f"x.shape[{d}]={x.shape[d]} (scatter_dim) is not divisible by the world size {ws}")
    k = _chunks_per_rank(chunks, ws, x.shape[d] // ws, d)
    transport_ = _check_transport(transport, group, x.device)
    xm = x.movedim(d, 0)
    with autocast_off(xm, cdt):
        out = mm_rs(rows(xm), weight.t(), k, group, transport_, name=name)
    return out.view(xm.shape[0] // ws, *xm.shape[1:-1], weight.shape[0]).movedim(0, d)


# -- the differentiable sequence-parallel linears (bodies and autograd in ops.py) ---------

def _check_linear(x: torch.Tensor, weight: torch.Tensor, bias, what: str) -> None:
    _check_dim(x, 0, "the sequence dim")
    _check_weight(x, weight, f"{what} weight")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype or bias.device != x.device):
        raise ValueError(f"{what} bias must be [{weight.shape[0]}] {x.dtype} on {x.device}, got "
                         f"{tuple(bias.shape)} {bias.dtype} on {bias.device}")


def column_parallel_linear_pipelined(x_shard: torch.Tensor, weight: torch.Tensor, bias, group, *,
                                     chunks: int | None = None, transport: str = "p2p",
                                     save_gathered_input: bool = False, name: str = "column") -> torch.Tensor:
    """Sequence-parallel column-parallel linear: [s/tp, ..., in] -> [s, ..., out/tp], differentiable.

    weight is this rank's [out/tp, in] rows, bias its [out/tp] slice (or None).
    """
    _check_linear(x_shard, weight, bias, "column-parallel")
    ws = comm.group_size(group)
    k = _chunks_per_rank(chunks, ws, x_shard.shape[0], 0)
    _check_transport(transport, group, x_shard.device)
    return ops.linear("column_pipelined", x_shard, weight, bias, group, k=k, transport=transport,
                      save_gathered=bool(save_gathered_input), name=name)


def row_parallel_linear_pipelined(x: torch.Tensor, weight: torch.Tensor, bias, group, *,
                                  chunks: int | None = None, transport: str = "p2p",
                                  name: str = "row") -> torch.Tensor:
    """Sequence-parallel row-parallel linear: [s, ..., in/tp] -> [s/tp, ..., out], differentiable.

    weight is this rank's [out, in/tp] columns, bias the full [out] (added after the reduce-scatter;
    its gradient is complete on every rank, as in RowParallelLinear).
    """
    _check_linear(x, weight, bias, "row-parallel")
    ws = comm.group_size(group)
    if x.shape[0] % ws != 0:
        raise ValueError(f"row-parallel: sequence length (dim 0) {x.shape[0]} is not divisible by the world size {ws}")
    k = _chunks_per_rank(chunks, ws, x.shape[0] // ws, 0)
    _check_transport(transport, group, x.device)
    return ops.linear("row_pipelined", x, weight, bias, group, k=k, transport=transport, name=name)
