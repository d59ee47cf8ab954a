"""Capacity-padded dispatch -> expert GEMMs -> combine: fixed split sizes, so nothing waits for the device; chunks overlap as in dispatch.py.

With a capacity factor every expert takes at most C = ceil(f · T · top_k / E) of one rank's
assignments. Padding every (source rank, expert) pair to C rows makes every transfer the same
size on every rank, known from the shapes alone: no counts exchange to wait for, no host sync,
and the experts run as one batched GEMM pair over [local experts, ep · C rows] (the biases in the
GEMMs). The price is the padding: C rows per pair whatever the routing sent (f× the rows of an
even routing, moved and computed), and every rank of the EP group must route the same number of
tokens T (checked across ranks on each new T).

Chunks cut the slots, not the tokens: chunk i holds queue places [p_i, p_i+1) of every expert
(`chunk_bounds(C, chunks)`), so which assignments are admitted, and every result, is the same for
any chunk count. The padded buffer is laid out chunk-major — chunk i is the [E, w_i] block of rows
E·p_i … E·p_i+1 — so each chunk's transfer is one contiguous equal-split all-to-all. Row E·C is a
row of zeros that dropped assignments point at: their output is 0, their gradient goes nowhere.

The all-to-all of the per-expert counts still runs (for `MoE.last_load`), asynchronously, beside
the chunks; nothing waits for it on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runtime import comm
from ..runtime.recorder import compute_span
from ..runtime.tuning import timed
from . import pairwise
from .dispatch import DONE, RANKS, chunk_bounds, chunk_of, positions, schedule
from .experts import batched_backward, batched_forward, fill_grads


@dataclass
class PaddedPlan:
    """Where each (token, choice) assignment sits in the padded buffer of one forward."""

    slot: torch.Tensor
    """[tokens * top_k] the assignment's row in the chunk-major padded buffer, or E·C (the zero row) if dropped."""
    capacity: int
    """C: rows each expert takes from each rank."""
    bounds: list[int]
    """Chunk boundaries over the queue places 0 … C (chunk i: places bounds[i] … bounds[i+1])."""
    by_rank: bool
    """chunks="ranks": one slot chunk, pipelined by source rank (pairwise.py) instead."""
    top_k: int
    sent_per_expert: torch.Tensor
    """[num_experts] assignments of this rank's tokens each expert takes."""
    dropped_per_expert: torch.Tensor
    """[num_experts] assignments of this rank's tokens dropped for lack of capacity."""
    received_per_source: torch.Tensor
    """[ep * local experts] rows each source rank sent each local expert (filled by the counts' all-to-all)."""
    counts_handle: object
    """The counts' all-to-all in flight; waited for at the end of the forward (a stream wait on CUDA)."""


def plan_padded(experts: torch.Tensor, num_experts: int, chunks, capacity: int, group, name: str,
                per_expert: torch.Tensor | None = None) -> PaddedPlan:
    """The padded plan of one forward (`chunks`: a count or "ranks"; `per_expert`: the assignments per expert
    if the caller counted them); issues the (asynchronous) counts all-to-all over the EP group."""
    ep = comm.group_size(group)
    by_rank = chunks == RANKS and ep > 1
    chunks = 1 if chunks == RANKS else chunks
    flat = experts.reshape(-1)
    place, per_expert = positions(flat, experts.shape[1], num_experts, per_expert)
    keep = place < capacity
    c = capacity
    if c and chunks == 1:  # one chunk of width C starting at place 0
        slot = torch.where(keep, flat * c + place, num_experts * c)
    elif c:
        piece = chunk_of(place.clamp(max=c - 1), c, chunks)
        start = (piece * c).div_(chunks, rounding_mode="floor")
        width = ((piece + 1) * c).div_(chunks, rounding_mode="floor") - start
        slot = torch.where(keep, num_experts * start + flat * width + place - start, num_experts * c)
    else:  # no tokens anywhere (T = 0 on every rank): nothing has a slot
        slot = torch.zeros_like(flat)
    sent = per_expert.clamp(max=c)
    received, handle = sent, DONE  # [ep * local]: what each source rank sends each local expert
    if ep > 1:
        received = torch.empty_like(sent)
        handle = comm.all_to_all_single(received, sent, group, kind="ep_dispatch", name=f"{name}.fwd.counts")
    return PaddedPlan(slot=slot, capacity=c, bounds=chunk_bounds(c, chunks), by_rank=by_rank, top_k=experts.shape[1],
                      sent_per_expert=sent, dropped_per_expert=per_expert - sent, received_per_source=received,
                      counts_handle=handle)


def _chunk_views(plan: PaddedPlan, num_experts: int):
    """(chunk, first row, last row, width) of each chunk of the padded buffer that holds any place (the same
    on every rank: C is)."""
    out = []
    for i in range(len(plan.bounds) - 1):
        a, b = plan.bounds[i], plan.bounds[i + 1]
        if b > a:
            out.append((i, num_experts * a, num_experts * b, b - a))
    return out


def _run(plan: PaddedPlan, send: torch.Tensor, result: torch.Tensor, group, num_experts: int, compute, name: str):
    """The padded pipeline: chunk i's rows send[E·p_i : E·p_i+1] to their experts' ranks, `compute(i, x)` on
    x [local, ep · w_i, hidden] (rows by source rank within each expert), the outputs back into
    result[E·p_i : E·p_i+1] — d0, d1, [compute 0], c0, ... as `schedule` runs them."""
    ep = comm.group_size(group)
    local = num_experts // ep
    if plan.by_rank:
        _run_by_rank(plan, send, result, group, local, compute, name)
        return
    chunks = _chunk_views(plan, num_experts)
    hidden = send.shape[1]

    def dispatch(i):
        c, a, b, w = chunks[i]
        if ep == 1:
            return send[a:b], DONE
        got = send.new_empty((b - a, hidden))
        return got, comm.all_to_all_single(got, send[a:b], group, kind="ep_dispatch", name=f"{name}.dispatch[{c}]")

    def run(i, got):
        c, a, b, w = chunks[i]
        x = got.view(ep, local, w, hidden).transpose(0, 1).reshape(local, ep * w, hidden)
        if ep == 1:
            compute(c, x, result[a:b].view(local, w, -1))  # written in place
            return None
        y = compute(c, x, None)
        back = y.new_empty((b - a, y.shape[-1]))
        back.view(ep, local, w, -1).copy_(y.view(local, ep, w, -1).transpose(0, 1))
        return back

    def combine(i, back):
        if back is None:
            return DONE
        c, a, b, _ = chunks[i]
        return comm.all_to_all_single(result[a:b], back, group, kind="ep_combine", name=f"{name}.combine[{c}]")

    schedule(len(chunks), dispatch, run, combine)


def _run_by_rank(plan: PaddedPlan, send: torch.Tensor, result: torch.Tensor, group, local: int, compute, name: str):
    """`_run` under chunks="ranks": rank d's rows are send[d·local·C : (d+1)·local·C], [local, C, hidden]."""
    ep, me, c = comm.group_size(group), comm.group_rank(group), plan.capacity
    step = local * c
    received = send.new_empty((ep * step, send.shape[1]))

    def run(src, got, out):
        y = compute(src, got.view(local, c, -1), None if out is None else out.view(local, c, -1))
        return None if y is None else y.reshape(step, -1)

    views = lambda t: [t[d * step:(d + 1) * step] for d in range(ep)]  # noqa: E731
    pairwise.run(me, ep, group, views(send), views(received), views(result), run, name)


class PaddedExpertsA2A(torch.autograd.Function):
    """x [tokens, hidden] -> [tokens * top_k, hidden]: each assignment's expert output (0 if dropped), through
    the capacity-padded pipeline; backward the same pipeline on the gradients. No host sync either way."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, plan: PaddedPlan, group, add_output_bias: bool, name: str, trial=None):
        num_experts = w1.shape[0] * comm.group_size(group)
        rows = num_experts * plan.capacity
        ctx.plan, ctx.group, ctx.name, ctx.trial, ctx.num_experts = plan, group, name, trial, num_experts
        ctx.saved = {}  # by chunk
        slots = plan.slot.view(-1, plan.top_k)
        send = x.new_zeros((rows + 1, x.shape[1]))
        for j in range(plan.top_k):  # dropped ones all land on row E·C, which is never sent
            send.index_copy_(0, slots[:, j], x)
        result = x.new_empty((rows + 1, w2.shape[1]))
        result[rows].zero_()

        def compute(i, xs, out):
            with compute_span(f"{name}.fwd.experts[{i}]"):
                y, pre = batched_forward(xs, w1, b1, w2, b2, add_output_bias, out=out)
            ctx.saved[i] = (xs, pre)
            return y

        if rows:
            _run(plan, send, result, group, num_experts, compute, f"{name}.fwd")
        ctx.save_for_backward(w1, w2)
        return result.index_select(0, plan.slot)

    @staticmethod
    def backward(ctx, dslots):
        with timed(ctx.trial, "backward"):  # auto's trials time it; nothing once decided
            return PaddedExpertsA2A._backward(ctx, dslots)

    @staticmethod
    def _backward(ctx, dslots):
        plan, name, num_experts = ctx.plan, ctx.name, ctx.num_experts
        w1, w2 = ctx.saved_tensors
        rows = num_experts * plan.capacity
        grads = [None] * 4
        dy = dslots.new_zeros((rows + 1, dslots.shape[1]))
        dy.index_copy_(0, plan.slot, dslots.contiguous())  # empty slots keep dy = 0: padding adds nothing
        dx = dslots.new_empty((rows + 1, w1.shape[2]))
        dx[rows].zero_()

        def compute(i, dys, out):
            with compute_span(f"{name}.bwd.experts[{i}]"):
                xs, pre = ctx.saved[i]
                d = batched_backward(dys, xs, pre, w1, w2, grads)
            if out is None:
                return d
            out.copy_(d)
            return None

        if rows:
            _run(plan, dy, dx, ctx.group, num_experts, compute, f"{name}.bwd")
        ctx.saved = None
        slots = plan.slot.view(-1, plan.top_k)
        dx2 = dx.index_select(0, slots[:, 0])
        for j in range(1, plan.top_k):
            dx2 = dx2 + dx.index_select(0, slots[:, j])
        fill_grads(grads, w1, w2)  # experts no chunk reached
        return dx2, grads[0], grads[1], grads[2], grads[3], None, None, None, None, None


def received_per_expert(plan: PaddedPlan, ep: int) -> torch.Tensor:
    """Wait for the counts' all-to-all (a stream wait on CUDA, no host sync) and return the rows each local
    expert computed, from every rank."""
    plan.counts_handle.wait()
    return plan.received_per_source.view(ep, -1).sum(0)
