"""Where an activation's rows lie, so that every GEMM of the parallel layers reads a dense [rows, features] matrix.

Nothing here overlaps anything; it keeps the kernels that do fast. A GEMM on a [b, s, h] view
whose rows are not one dense block (the transposed view a sequence-first layer would make of
every HF model's batch-first activation) runs as a batched GEMM several times slower than
`mm`, and copying it into shape first costs an activation-sized copy per layer.

The rule: the rows may lie in any order a GEMM likes — it treats each independently — unless
they travel by sequence (sequence parallelism over several ranks: the all-gather and the
reduce-scatter cut the sequence dim), when the sequence dim must be outermost. So inside a
sequence-parallel region activations are kept *sequence-major* (stored [s, b, h], seen as
[b, s, h]): `ScatterSequence` hands them out so, each layer computes on the stored order and
returns the same layout as a view, and elementwise work between layers (norms, residual adds,
activations) keeps it. An input that arrives in another order (HF attention returns its output
batch-major) is copied once, and only where its rows must travel.
"""

from __future__ import annotations

import torch


def gemm_order(x: torch.Tensor, seq_first: int | None = None) -> tuple[int, ...] | None:
    """The order of x's dims in which it reads as a dense [rows, features] matrix; None for its own order.

    The leading dims go in the order of their strides (outermost first), so a tensor already
    dense in some order needs no copy; `seq_first` (a dim) is put outermost whatever its
    stride, for rows that travel by sequence. The last dim (features) stays last.
    """
    n = x.dim()
    # Size-1 dims carry no layout (their stride is arbitrary): they keep their place.
    lead = sorted(range(n - 1), key=lambda d: -x.stride(d) if x.shape[d] > 1 else 0)
    if seq_first is not None:
        lead.remove(seq_first)
        lead.insert(0, seq_first)
    order = (*lead, n - 1)
    return None if order == tuple(range(n)) else order


def as_rows(x: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """x permuted to `order` (a view), copied only when that view is not dense."""
    xg = x.permute(order) if order is not None else x
    return xg if xg.is_contiguous() else xg.contiguous()


def restore(y: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """y, computed in `order`, seen in the caller's order again (a view: the layout stays `order`'s)."""
    if order is None:
        return y
    inverse = [0] * len(order)
    for i, d in enumerate(order):
        inverse[d] = i
    return y.permute(inverse)


def needs_copy(x: torch.Tensor, order: tuple[int, ...] | None) -> bool:
    """Whether `as_rows(x, order)` copies."""
    return not (x.permute(order) if order is not None else x).is_contiguous()
