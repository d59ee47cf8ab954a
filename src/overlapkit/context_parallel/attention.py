"""Ring attention as an autograd function and a module: the K/V transfers hide behind each block's attention.

`ring_attention(q, k, v, group)` takes this rank's slice of the sequence (laid out by `split`)
and returns softmax(q kᵀ·scale)·v over the *whole* sequence for its queries, equal to
attention in one process; backward returns the exact gradients of the local q, k and v. The
schedule and its overlap live in `ring.py`; this file checks the inputs (the same on every
rank, via `overlapkit.runtime.agreement`) and wires the schedule into autograd; `gather.py` holds the
all-gather schedule (`overlap="bulk"`), which computes the same blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..runtime.agreement import Agreement
from ..runtime.comm import group_rank, group_size
from ..runtime.groups import resolve_group
from ..runtime.tuning import MeasuredChoice, timed
from ..vocabulary import OVERLAP_MEANING, positive_int
from .kernels import KERNELS, check_kernel
from .gather import gather_backward, gather_forward
from .ring import Ring, ring_backward, ring_forward
from .split import LAYOUTS, check_layout, chunks_per_rank

OVERLAPS = tuple(OVERLAP_MEANING["cp"])
"""`none`: each K/V transfer after the block it could hide behind (the reference); `pipelined`: the ring,
the next block in flight while this one computes; `bulk`: every block sent to every rank at the start of
the pass, each attended as it lands (all P−1 blocks held at once, see gather.py); `auto`: `none` at cp = 1
(nothing travels), else the three timed on the first calls of a configuration (forward and backward, the
slowest rank's median) and the fastest kept, the same on every rank."""

AUTO_CANDIDATES = ("pipelined", "bulk", "none")
"""What `overlap="auto"` times, in order of preference on a tie (the ring holds the least memory)."""


def forward_pass(ring: Ring, q, k, v):
    """The forward schedule `ring.overlap` names: (out fp32, lse fp32, rests, the K/V block backward starts on)."""
    return (gather_forward if ring.overlap == "bulk" else ring_forward)(ring, q, k, v)


def backward_pass(ring: Ring, dout, q, k, v, out, lse, rests, first):
    """The backward schedule `ring.overlap` names: (dq, dk, dv) in fp32."""
    return (gather_backward if ring.overlap == "bulk" else ring_backward)(ring, dout, q, k, v, out, lse, rests, first)


@dataclass(frozen=True)
class ContextParallelConfig:
    """How ring attention cuts the sequence, computes its blocks and overlaps its transfers."""

    overlap: str = "auto"
    """`pipelined` (the ring: the next K/V block travels while this one's attention runs), `bulk` (every
    block sent at the start of the pass, attended as it lands; holds all P−1 blocks at once), `none`
    (sequential), or `auto` (measured once per configuration and kept: see OVERLAPS)."""
    layout: str = "zigzag"
    """How the sequence is cut over CP ranks (see split.py): `zigzag` balances causal work; `contiguous`."""
    kernel: str = "auto"
    """Block attention: `math` (matmuls, fp32 scores), `flash` (PyTorch's fused kernels: cuDNN's where
    it runs, else flash, on CUDA; see kernels.py), or `auto`: flash on CPU and for fp16/bf16 on CUDA,
    math for fp32 on CUDA (the CUDA fused kernels have no fp32)."""
    prefetch: int | None = None
    """Under `overlap="bulk"` (and auto's trial of it): how many steps ahead each K/V block is requested, i.e.
    how many travel at once; None: all P−1 at the start of the pass. Fewer at once share the link with fewer
    (gloo interleaves concurrent transfers, so with all in flight the block needed first arrives later) and
    hold less memory (prefetch + 1 received blocks at most, against P−1); 1 is the ring's timing without its
    chain (every block comes from its owner)."""

    def __post_init__(self) -> None:
        if self.overlap not in OVERLAPS:
            raise ValueError(f"ContextParallelConfig.overlap={self.overlap!r} is not one of {OVERLAPS}")
        if self.prefetch is not None:
            positive_int(self.prefetch, "ContextParallelConfig.prefetch")
        check_layout(self.layout, "ContextParallelConfig.layout")
        if self.kernel not in (*KERNELS, "auto"):
            raise ValueError(f"ContextParallelConfig.kernel={self.kernel!r} is not one of {(*KERNELS, 'auto')}")

    def kernel_for(self, q: torch.Tensor) -> str:
        if self.kernel != "auto":
            return self.kernel
        return "math" if q.is_cuda and q.dtype not in (torch.float16, torch.bfloat16) else "flash"


class _RingAttention(torch.autograd.Function):
    """K/V blocks to every rank in forward (the ring, or all at once); dK/dV back to their owners in backward.

    Keeps one received K/V block (rank r−1's) from forward beyond what attention saves anyway, so that
    backward can start computing at once (memory: one more local K/V)."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, trial=None):
        with timed(trial, "forward"):  # auto's trials time it; nothing once decided
            out, lse, rests, first = forward_pass(ring, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse, *(first or ()))
        ctx.ring, ctx.rests, ctx.trial = ring, rests, trial
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *first = ctx.saved_tensors
        with timed(ctx.trial, "backward"):
            dq, dk, dv = backward_pass(ctx.ring, dout, q, k, v, out, lse, ctx.rests, first or None)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _check_shapes(q, k, v) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"ring attention wants q, k, v as [batch, heads, seq, head_dim]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    b, h, s, d = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, s, d):
        raise ValueError(f"k/v {tuple(k.shape)} do not match q {tuple(q.shape)} in batch, local sequence or head_dim")
    if h % k.shape[1]:
        raise ValueError(f"{h} query heads are not a multiple of {k.shape[1]} key/value heads (grouped-query attention)")


class OverlapChoices:
    """`overlap="auto"`'s choice per configuration (shapes, dtype, causal, layout, kernel, group), each
    measured once and kept (`overlapkit.runtime.tuning.MeasuredChoice`); `reset()` forgets them (tests)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._choices: dict = {}

    def get(self, key: tuple, group, size: int) -> MeasuredChoice:
        choice = self._choices.get(key)
        if choice is None:
            choice = self._choices[key] = MeasuredChoice(AUTO_CANDIDATES, group, what=self.what, kind="cp_kv")
            if size == 1:
                choice.decide_now("none", "cp = 1: nothing travels, so nothing to overlap")
        return choice

    def choices(self) -> dict:
        """{configuration: its MeasuredChoice} so far."""
        return dict(self._choices)

    def reset(self) -> None:
        self._choices.clear()


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh_or_group=None, *, causal: bool = True,
                   scale: float | None = None, config: ContextParallelConfig = ContextParallelConfig(),
                   name: str = "cp.attn", agreement: Agreement | None = None,
                   choices: OverlapChoices | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence held by the CP group; [b, h, s_local, d].

    q [b, h, s_local, d], k and v [b, h_kv, s_local, d] (h a multiple of h_kv: grouped-query
    attention) are this rank's tokens in the order `split.shard(..., layout=config.layout)`
    gives. `mesh_or_group`: a CP ProcessGroup, a DeviceMesh with a "cp" dim, a ParallelGroups.
    The first call of a configuration checks that every rank of the group passed the same
    shapes and settings (a mismatch raises RankMismatchError on every rank).
    """
    group = resolve_group(mesh_or_group, "cp")
    _check_shapes(q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    kernel = config.kernel_for(q)
    check_kernel(kernel, q)
    size, rank = group_size(group), group_rank(group)
    (agreement or _AGREEMENT).check(group, q=tuple(q.shape), kv=tuple(k.shape), dtype=q.dtype, causal=bool(causal),
                                    scale=scale, overlap=config.overlap, prefetch=config.prefetch, layout=config.layout,
                                    kernel=kernel)
    per = chunks_per_rank(config.layout)
    if q.shape[2] % per:
        raise ValueError(f"local sequence length {q.shape[2]} does not split into the {per} equal chunks each rank "
                         f"holds under layout={config.layout!r} (the whole sequence must be a multiple of {per * size})")
    overlap, trial = config.overlap, None
    if overlap == "auto":
        choice = (choices or _CHOICES).get((group, tuple(q.shape), tuple(k.shape), q.dtype, q.device.type,
                                            bool(causal), scale, config.layout, kernel, config.prefetch), group, size)
        overlap = choice.decided
        if overlap is None:  # still timing: this call runs one candidate
            trial = choice.trial(q.device)
            overlap = choice.decided if trial is None else trial.choice
    ring = Ring(group=group, rank=rank, size=size, layout=config.layout, chunk=q.shape[2] // per,
                causal=bool(causal), scale=scale, kernel=kernel, overlap=overlap, name=name, prefetch=config.prefetch)
    return _RingAttention.apply(q, k, v, ring, trial)


_AGREEMENT = Agreement("context_parallel.ring_attention")
"""Configurations `ring_attention` has checked across ranks (process state: a seen one costs a set lookup)."""
_CHOICES = OverlapChoices("context_parallel.ring_attention overlap")
"""`overlap="auto"`'s kept choices for calls of `ring_attention` itself (a RingAttention module keeps its own)."""


class RingAttention(nn.Module):
    """`ring_attention` as a module over a fixed CP group: q, k, v [b, h, s_local, d] -> [b, h, s_local, d]."""

    def __init__(self, mesh_or_group, config: ContextParallelConfig = ContextParallelConfig(), *,
                 causal: bool = True, name: str = "cp.attn") -> None:
        super().__init__()
        self.group = resolve_group(mesh_or_group, "cp")
        self.config, self.causal, self.name = config, causal, name
        self._agreement = Agreement(f"context_parallel.RingAttention({name})")
        self.overlap_choices = OverlapChoices(f"{name} overlap")
        """`overlap="auto"`'s choice per input configuration of this module, and why."""

    def forward(self, q, k, v, scale: float | None = None):
        return ring_attention(q, k, v, self.group, causal=self.causal, scale=scale, config=self.config,
                              name=self.name, agreement=self._agreement, choices=self.overlap_choices)

    def extra_repr(self) -> str:
        return f"cp={group_size(self.group)}, causal={self.causal}, {self.config}"


__all__ = ["ContextParallelConfig", "RingAttention", "ring_attention", "OVERLAPS", "AUTO_CANDIDATES", "forward_pass", "backward_pass",
           "OverlapChoices", "LAYOUTS", "KERNELS"]
