"""The experts of one EP rank and their GEMMs, forward and backward, on tokens grouped by expert.

These GEMMs are what the dispatch and combine all-to-alls of other chunks hide behind
(dispatch.py holds that schedule); here is only the arithmetic: for each local expert e,
y = gelu(x W1_e^T + b1_e) W2_e^T + b2_e, and its hand-written backward, so that one chunk's
backward can run between the transfers of its neighbours.

With tensor parallelism inside the experts, W1 is split by rows (column-parallel) and W2 by
columns (row-parallel) over the TP group: y is then a partial sum, which the MoE layer adds up
over TP after the combine; b2 is added on TP rank 0 only, so that it counts once.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime import state


class Experts(nn.Module):
    """`num_local` expert MLPs stacked: w1 [E, F, H], b1 [E, F], w2 [E, H, F], b2 [E, H].

    Every parameter is marked `expert_parallel = True` (held by one EP rank, not replicated
    over it: a data-parallel gradient sum over the EP ranks would mix different experts).
    """

    def __init__(self, num_local: int, hidden: int, ffn_local: int, *, add_output_bias: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.w1 = nn.Parameter(torch.empty(num_local, ffn_local, hidden, **kw))
        self.b1 = nn.Parameter(torch.empty(num_local, ffn_local, **kw))
        self.w2 = nn.Parameter(torch.empty(num_local, hidden, ffn_local, **kw))
        self.b2 = nn.Parameter(torch.empty(num_local, hidden, **kw))
        self.add_output_bias = add_output_bias
        """False on TP ranks other than 0: the partial outputs are summed over TP, b2 must count once."""
        for p in self.parameters():
            p.expert_parallel = True

    @torch.no_grad()
    def load_full(self, w1, b1, w2, b2, experts: slice, ffn: slice = slice(None)) -> None:
        """Copy this rank's experts (and TP slice of the inner width) out of full stacked tensors."""
        self.w1.copy_(w1[experts, ffn])
        self.b1.copy_(b1[experts, ffn])
        self.w2.copy_(w2[experts][:, :, ffn])
        self.b2.copy_(b2[experts])


def init_full_experts(num_experts: int, hidden: int, ffn_hidden: int, generator=None, dtype=torch.float32):
    """Full stacked expert weights initialised like nn.Linear (uniform in +-1/sqrt(fan_in)).

    Every rank draws the same full tensors from the same generator state and keeps its slice,
    so a layer sharded over any EP x TP layout starts equal to its single-process twin.
    """
    def uniform(shape, fan_in):
        bound = 1.0 / math.sqrt(fan_in)
        return (torch.rand(shape, generator=generator, dtype=dtype) * 2 - 1) * bound

    return (uniform((num_experts, ffn_hidden, hidden), hidden), uniform((num_experts, ffn_hidden), hidden),
            uniform((num_experts, hidden, ffn_hidden), ffn_hidden), uniform((num_experts, hidden), ffn_hidden))


# Grouped GEMMs (torch._grouped_mm): one kernel for all the local experts instead of one GEMM per
# expert, which at MoE shapes is mostly host dispatch (the per-expert loop made the layer ~7x a dense
# MLP of the same active width, ep_overlap_cuda_ws1.md; grouped, an H200 runs a chunk's experts in
# 0.4-0.7x the loop's time, ep_grouped_probe_cuda.md). GPUs only: on CPU it gains nothing (0.9-1.0x
# the loop on 16 cores, ep_grouped_probe_cpu16.md). Not every build runs every dtype or layout
# (CUDA's kernel wants 16-byte aligned rows): a (device, dtype, expert shape) that raises once goes
# back to the loop for good. The loop is kept for autocast (whose casts the grouped op does not take
# part in), for chunks that receive no rows, and as the tests' reference.
GROUPED_DEVICES = {"cuda"}
_GROUPED_BROKEN: set = state.capability_set("experts.grouped_mm_refused")


def _key(x: torch.Tensor, w1: torch.Tensor) -> tuple:
    return x.device.type, x.dtype, tuple(w1.shape[1:])


def grouped_on(device) -> bool:
    """Whether expert GEMMs on `device` take the grouped path (where dtype and layout allow)."""
    return torch.device(device).type in GROUPED_DEVICES and hasattr(torch, "_grouped_mm")


def _grouped(x: torch.Tensor, w1: torch.Tensor, *ws: torch.Tensor) -> bool:
    """Whether these operands go through torch._grouped_mm (else the per-expert loop)."""
    return (x.device.type in GROUPED_DEVICES and hasattr(torch, "_grouped_mm") and x.dim() == 2 and x.shape[0] > 0
            and _key(x, w1) not in _GROUPED_BROKEN and all(w.dtype == x.dtype for w in (w1, *ws))
            and not torch.is_autocast_enabled(x.device.type))


def device_ints(values: list[int], device) -> torch.Tensor:
    """An int64 tensor of `values` on `device` without a host sync (a plain copy to a GPU waits for
    the stream; a pinned one is queued on it like a kernel)."""
    t = torch.tensor(values, dtype=torch.long)
    return t.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else t


def count(index: torch.Tensor, n: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """[n] int64: how often each value in [0, n) occurs in `index` (weighted by a mask if given).
    torch.bincount sizes its output from the data's maximum: a host sync on a GPU."""
    ones = index.new_ones(1).expand_as(index) if weights is None else weights.to(index.dtype)
    return torch.zeros(n, dtype=index.dtype, device=index.device).scatter_add_(0, index, ones)


class Groups:
    """How rows sorted by local expert split into experts: the device counts, and what each GEMM path needs
    from them, computed on first use (a chunk's are slices of tensors its dispatch plan made once per layer).

    `sizes` (host ints, for the per-expert loop) is a device sync on a GPU when not given up front.
    """

    __slots__ = ("counts", "rows", "_sizes", "_ends", "_expert")

    def __init__(self, counts: torch.Tensor, rows: int, sizes: list[int] | None = None,
                 ends: torch.Tensor | None = None, expert: torch.Tensor | None = None) -> None:
        self.counts, self.rows = counts, rows
        self._sizes, self._ends, self._expert = sizes, ends, expert

    @classmethod
    def of(cls, sizes, device) -> "Groups":
        """Groups from host `sizes` (a list), or `sizes` itself if it is one."""
        if isinstance(sizes, Groups):
            return sizes
        sizes = list(sizes)
        return cls(device_ints(sizes, device), sum(sizes), sizes)

    @property
    def sizes(self) -> list[int]:
        if self._sizes is None:
            self._sizes = self.counts.tolist()
        return self._sizes

    @property
    def ends(self) -> torch.Tensor:
        """[experts] int32: each group's end row, as torch._grouped_mm takes its offsets."""
        if self._ends is None:
            self._ends = self.counts.cumsum(0).to(torch.int32)
        return self._ends

    @property
    def expert(self) -> torch.Tensor:
        """[rows] the local expert of each row (to add the biases)."""
        if self._expert is None:
            self._expert = torch.repeat_interleave(torch.arange(self.counts.numel(), device=self.counts.device),
                                                   self.counts, output_size=self.rows)
        return self._expert


def _try_grouped(key: tuple, fn):
    """fn()'s result, or None where this build refuses the grouped op (remembered under `key`)."""
    try:
        return fn()
    except torch.OutOfMemoryError:
        raise
    except RuntimeError:
        _GROUPED_BROKEN.add(key)
        return None


def experts_forward(x: torch.Tensor, groups, w1, b1, w2, b2, add_output_bias: bool):
    """y for rows `x` grouped by local expert (`groups`: a Groups, or the rows per expert as a list);
    also the pre-activations for backward."""
    if x.shape[0] == 0:  # a chunk that received nothing
        return x.new_empty((0, w2.shape[1])), x.new_empty((0, w1.shape[1]))
    g = Groups.of(groups, x.device)

    def grouped():
        pre = torch._grouped_mm(x, w1.transpose(1, 2), offs=g.ends).add_(b1.index_select(0, g.expert))
        y = torch._grouped_mm(F.gelu(pre), w2.transpose(1, 2), offs=g.ends)
        return (y.add_(b2.index_select(0, g.expert)) if add_output_bias else y), pre

    done = _try_grouped(_key(x, w1), grouped) if _grouped(x, w1, w2, b1, b2) else None
    return done if done is not None else _loop_forward(x, g.sizes, w1, b1, w2, b2, add_output_bias)


def experts_backward(dy: torch.Tensor, x: torch.Tensor, pre: torch.Tensor, groups, w1, w2,
                     grads: list) -> torch.Tensor:
    """dx for the grouped rows; adds dW1, db1, dW2, db2 of these rows into `grads` (in that order; an entry
    that is None is set instead of added to, so the first chunk allocates nothing)."""
    if dy.shape[0] == 0:  # nothing to add to the gradients
        return dy.new_empty((0, w1.shape[2]))
    g = Groups.of(groups, dy.device)

    def grouped():  # every product, nothing into `grads`: a refusal leaves them untouched
        # wgrads: groups along the contraction (rows); an expert with no rows gets zeros.
        dw2 = torch._grouped_mm(dy.t(), F.gelu(pre), offs=g.ends)
        da = torch.ops.aten.gelu_backward(torch._grouped_mm(dy, w2, offs=g.ends), pre)
        dw1 = torch._grouped_mm(da.t(), x, offs=g.ends)
        dx = torch._grouped_mm(da, w1, offs=g.ends)
        # Bias gradients as one small GEMM with the rows' one-hot experts: deterministic, unlike an
        # atomic index_add, and unlike segment_reduce (2 ms for one large group on an H200) fast.
        # (Built directly in dy's dtype: F.one_hot's int64 result would need a cast, and on CPU it reads its
        # input's minimum back to the host.)
        onehot = dy.new_zeros((dy.shape[0], w1.shape[0])).scatter_(1, g.expert.unsqueeze(1), 1.0)
        return dx, (dw1, onehot.t() @ da, dw2, onehot.t() @ dy)  # db2 on every TP rank: dy is whole there

    done = _try_grouped(_key(dy, w1), grouped) if _grouped(dy, w1, x, pre, w2) else None
    if done is None:
        fill_grads(grads, w1, w2)
        return _loop_backward(dy, x, pre, g.sizes, w1, w2, grads)
    dx, parts = done
    accumulate(grads, parts)
    return dx


def accumulate(grads: list, parts) -> None:
    """grads[i] += parts[i], or grads[i] = parts[i] where it is still None."""
    for i, d in enumerate(parts):
        grads[i] = d if grads[i] is None else grads[i].add_(d)


def fill_grads(grads: list, w1, w2) -> None:
    """Zeros for the entries of [dW1, db1, dW2, db2] still None (no rows reached them)."""
    for i, shape in enumerate((w1.shape, w1.shape[:2], w2.shape, w2.shape[:2])):
        if grads[i] is None:
            grads[i] = torch.zeros(shape, dtype=w1.dtype, device=w1.device)


def batched_forward(x: torch.Tensor, w1, b1, w2, b2, add_output_bias: bool, out: torch.Tensor | None = None):
    """(y, pre) for x [local experts, rows, hidden], the same number of rows for every expert (padded to a
    capacity): one batched GEMM pair for all experts, the biases in the GEMMs; y written into `out` if given."""
    pre = torch.baddbmm(b1.unsqueeze(1), x, w1.transpose(1, 2))
    h = F.gelu(pre)
    w2t = w2.transpose(1, 2)
    if add_output_bias:
        y = torch.baddbmm(b2.unsqueeze(1), h, w2t, out=out) if out is not None else torch.baddbmm(b2.unsqueeze(1), h, w2t)
    else:
        y = torch.bmm(h, w2t, out=out) if out is not None else torch.bmm(h, w2t)
    return y, pre


def batched_backward(dy: torch.Tensor, x: torch.Tensor, pre: torch.Tensor, w1, w2, grads: list) -> torch.Tensor:
    """dx [local, rows, hidden] of `batched_forward`; its weight and bias gradients into `grads` (as
    `experts_backward`). Rows that were padding carry dy = 0, so they add exact zeros."""
    da = torch.ops.aten.gelu_backward(torch.bmm(dy, w2), pre)
    accumulate(grads, (torch.bmm(da.transpose(1, 2), x), da.sum(1), torch.bmm(dy.transpose(1, 2), F.gelu(pre)),
                       dy.sum(1)))
    return torch.bmm(da, w1)


def _loop_forward(x: torch.Tensor, sizes: list[int], w1, b1, w2, b2, add_output_bias: bool):
    """experts_forward one expert at a time (two addmm each)."""
    pre = x.new_empty((x.shape[0], w1.shape[1]))
    y = x.new_empty((x.shape[0], w2.shape[1]))
    # Written in place (row slices of contiguous tensors), except under autocast, which casts only the
    # functional forms: there the products are copied in.
    direct = not torch.is_autocast_enabled(x.device.type)
    off = 0
    for e, n in enumerate(sizes):
        if n:
            rows = slice(off, off + n)
            if direct:
                torch.addmm(b1[e], x[rows], w1[e].t(), out=pre[rows])
            else:
                pre[rows] = torch.addmm(b1[e], x[rows], w1[e].t())
            h = F.gelu(pre[rows])
            w2t = w2[e].t()
            if direct:
                torch.addmm(b2[e], h, w2t, out=y[rows]) if add_output_bias else torch.mm(h, w2t, out=y[rows])
            else:
                y[rows] = torch.addmm(b2[e], h, w2t) if add_output_bias else h @ w2t
            off += n
    return y, pre


def _loop_backward(dy: torch.Tensor, x: torch.Tensor, pre: torch.Tensor, sizes: list[int], w1, w2,
                   grads: list[torch.Tensor]) -> torch.Tensor:
    """experts_backward one expert at a time."""
    g_w1, g_b1, g_w2, g_b2 = grads
    dx = torch.empty_like(x)
    direct = not torch.is_autocast_enabled(x.device.type)
    off = 0
    for e, n in enumerate(sizes):
        if n:
            rows = slice(off, off + n)
            dy_e, a = dy[rows], pre[rows]
            g_w2[e].addmm_(dy_e.t(), F.gelu(a))
            g_b2[e].add_(dy_e.sum(0))  # on every TP rank: dy is whole there, b2 replicated
            da = torch.ops.aten.gelu_backward(dy_e @ w2[e], a)
            g_w1[e].addmm_(da.t(), x[rows])
            g_b1[e].add_(da.sum(0))
            if direct:
                torch.mm(da, w1[e], out=dx[rows])
            else:
                dx[rows] = da @ w1[e]
            off += n
    return dx
