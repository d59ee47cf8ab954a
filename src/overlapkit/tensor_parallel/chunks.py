"""The chunk kernels of pipelined TP: each chunk's GEMM runs as soon as its rows land (or its partial
product leaves while the next is computed), over a transport that moves the chunks.

Below `ops` (the differentiable linears) and `pipelined` (the public functions): both call these on
2-D row matrices, in the compute dtype, with every argument already checked.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from ..runtime import comm
from ..runtime import recorder as _recorder
from . import symm_mem
from .p2p import accum_dtype
from .precision import addmm_accumulate_

_NO_SPAN = contextlib.nullcontext()


def span(name: str, stream: str = "compute"):
    """recorder.compute_span, or one shared no-op context when neither a recorder nor a profiler
    runs: entering the generator context costs ~2 µs, paid by every GEMM of every linear."""
    if _recorder.active() is None and not _recorder.profiling():
        return _NO_SPAN
    return _recorder.compute_span(name, stream)


def single(k: int, group) -> bool:
    """One rank, one chunk: nothing to move and nothing to pipeline, so the pipelines are one GEMM
    (no receive buffer, no chunk loop); the same products, and the same spans."""
    return k == 1 and comm.group_size(group) == 1


def ag_mm(x2: torch.Tensor, weights: Sequence[torch.Tensor], k: int, group, transport, *,
           need_gathered: bool, name: str):
    """(gathered or None, [gather(x2) @ wᵀ for w in weights]) with the GEMMs pipelined per chunk."""
    if single(k, group):
        with span(f"{name}.gemm"):
            return (x2 if need_gathered else None), [torch.mm(x2, w.t()) for w in weights]
    ws = comm.group_size(group)
    outs = [x2.new_empty((ws * x2.shape[0], w.shape[0])) for w in weights]
    pairs = [(w.t(), out) for w, out in zip(weights, outs)]  # views made once, not once per chunk
    label = f"{name}.gemm"

    def consume(rows: slice, data: torch.Tensor, lane: int) -> None:
        with span(label, stream=lane_stream(lane)):
            for w_t, out in pairs:
                torch.mm(data, w_t, out=out[rows])

    gathered = transport.gather_and_consume(x2, consume, k, group, name=name, need_gathered=need_gathered)
    return gathered, outs


def mm_rs(x2: torch.Tensor, w_t: torch.Tensor, k: int, group, transport, *, name: str) -> torch.Tensor:
    """reduce_scatter(x2 @ w_t) over row blocks, the GEMM chunk by chunk under the transfers."""
    if single(k, group):
        with span(f"{name}.gemm"):
            return torch.mm(x2, w_t)

    label = f"{name}.gemm"

    def produce(rows: slice, out):
        with span(label):
            return torch.mm(x2[rows], w_t, out=out)

    return transport.produce_and_reduce_scatter(produce, x2.shape[0], w_t.shape[1], k, group,
                                                dtype=x2.dtype, device=x2.device, name=name)


def regather_wgrad(x2: torch.Tensor, dy2: torch.Tensor, k: int, group, transport, *, name: str) -> torch.Tensor:
    """Σ_i dY_iᵀ·X_i over the chunks X_i of gather(x2), each GEMM under the next chunk's transfer."""
    if single(k, group):
        with span(f"{name}.gemm"):
            return dy2.t() @ x2  # one product: nothing to accumulate over
    # One accumulator per stream lane: symm_mem consumes on two streams at once.
    lanes = 2 if transport is symm_mem else 1
    acc = [dy2.new_zeros((dy2.shape[1], x2.shape[1]), dtype=accum_dtype(dy2.dtype)) for _ in range(lanes)]

    def consume(rows: slice, data: torch.Tensor, lane: int) -> None:
        with span(f"{name}.gemm", stream=lane_stream(lane)):
            addmm_accumulate_(acc[lane], dy2[rows].t(), data)

    transport.gather_and_consume(x2, consume, k, group, name=name, need_gathered=False)
    total = acc[0] if lanes == 1 else acc[0] + acc[1]
    return total.to(dy2.dtype)


def lane_stream(lane: int) -> str:
    """Timeline lane of a chunk's GEMM: symm_mem runs every other one on its side stream."""
    return "compute" if lane == 0 else "compute.side"


def rows(x: torch.Tensor) -> torch.Tensor:
    """A [*lead, features] activation as a contiguous [rows, features] matrix (dim 0 outermost)."""
    return x.reshape(-1, x.shape[-1]).contiguous()
