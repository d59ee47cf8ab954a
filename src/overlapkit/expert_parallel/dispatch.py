"""Chunked dispatch -> expert GEMMs -> combine: the all-to-alls of chunks i+1 and i-1 in flight while chunk i computes.

`plan_dispatch` sorts a rank's (token, expert) assignments by chunk and destination expert,
drops what a capacity factor does not admit (counted), and exchanges the per-chunk, per-expert
row counts with one small all-to-all, so that every later all-to-all knows its split sizes on
both sides. `ExpertsA2A` is the autograd Function that runs the pipeline: forward dispatches
rows to their experts' ranks and combines the outputs back; backward runs the same pipeline on
the output gradients (dispatch dy, expert backward, combine dx), so that it overlaps alike.

Issue order, identical on every rank (the all-to-alls of one group must match):
    d0, d1, [experts 0], c0, d2, [experts 1], c1, d3, ...
so while the experts compute chunk i the dispatch of i+1 and the combine of i-1 are in flight.
chunks=1 degenerates to dispatch, compute, combine: the sequential reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import comm
from ..timeline.recorder import compute_span
from .experts import count, device_ints, experts_backward, experts_forward


@dataclass
class DispatchPlan:
    """Where every send row of one forward goes, and how many rows each rank gets back, per chunk."""

    row_token: torch.Tensor
    """[rows] the local token each send row carries (rows sorted by chunk, then expert)."""
    row_assignment: torch.Tensor
    """[rows] the flat (token * top_k + choice) assignment of each send row."""
    chunk_rows: list[int]
    """Send rows of each chunk (they are consecutive, chunk by chunk)."""
    send_splits: list[list[int]]
    """[chunk][ep rank] rows this rank sends to each EP rank."""
    recv_splits: list[list[int]]
    """[chunk][ep rank] rows this rank receives from each EP rank."""
    expert_rows: list[list[int]]
    """[chunk][local expert] rows this rank's experts compute."""
    expert_counts: list[torch.Tensor]
    """[chunk] the same counts on the device ([local experts], int64), for the grouped GEMMs' offsets."""
    group_perm: list[torch.Tensor] | None
    """[chunk] permutation taking received rows (by source rank, then expert) to rows by expert;
    None on one EP rank, where the rows arrive grouped by expert already."""
    group_inv: list[torch.Tensor] | None
    """[chunk] its inverse: rows by expert back to the order they were received in."""
    sent_per_expert: torch.Tensor
    """[num_experts] assignments of this rank's tokens each expert takes (after drops)."""
    dropped_per_expert: torch.Tensor
    """[num_experts] assignments of this rank's tokens dropped for lack of capacity."""
    received_per_expert: torch.Tensor
    """[local experts] rows this rank's experts computed, from every rank."""


def chunk_bounds(tokens: int, chunks: int) -> list[int]:
    """Token boundaries of `chunks` near-equal contiguous chunks (some empty when tokens < chunks)."""
    return [c * tokens // chunks for c in range(chunks + 1)]


def _admitted(flat_experts: torch.Tensor, top_k: int, num_experts: int, capacity: int | None) -> torch.Tensor:
    """Mask of assignments an expert admits: all when dropless, else the first `capacity` per expert,
    every token's first choice before any second choice, earlier tokens first."""
    if capacity is None:
        return torch.ones_like(flat_experts, dtype=torch.bool)
    n = flat_experts.numel()
    order = torch.arange(n, device=flat_experts.device).view(-1, top_k).t().reshape(-1)  # choice-major
    onehot = torch.nn.functional.one_hot(flat_experts[order], num_experts)
    position = (onehot.cumsum(0) - 1).gather(1, flat_experts[order, None]).squeeze(1)
    keep = torch.empty_like(flat_experts, dtype=torch.bool)
    keep[order] = position < capacity
    return keep


def plan_dispatch(experts: torch.Tensor, num_experts: int, chunks: int, capacity: int | None, group,
                  name: str) -> DispatchPlan:
    """Collective over the EP group (one all-to-all of counts): the plan of one forward.

    `experts` [tokens, top_k] are the router's choices on this rank.
    """
    ep = comm.group_size(group)
    tokens, top_k = experts.shape
    local = num_experts // ep
    dev = experts.device
    flat = experts.reshape(-1)
    keep = _admitted(flat, top_k, num_experts, capacity)
    token = torch.arange(flat.numel(), device=dev) // top_k
    bounds = device_ints(chunk_bounds(tokens, chunks)[1:-1], dev)
    chunk = torch.bucketize(token, bounds, right=True)
    key = chunk * num_experts + flat
    if capacity is not None:  # dropped assignments sort after every kept one, into a bin of their own
        key = torch.where(keep, key, chunks * num_experts)
    order = torch.argsort(key, stable=True)
    counts = count(key, chunks * num_experts + 1)[:-1].view(chunks, ep, local)
    # Counts first: every rank learns how many rows each peer will send it, chunk by chunk.
    send = counts.permute(1, 0, 2).contiguous()  # [dest rank, chunk, local expert]
    if ep > 1:
        recv = torch.empty_like(send)
        comm.all_to_all_single(recv, send, group, kind="ep_dispatch", name=f"{name}.fwd.counts", async_op=False)
    else:
        recv = send
    # The forward's one host sync: the split sizes of every all-to-all must be on the host.
    counts_l, recv_l = torch.stack([counts, recv.permute(1, 0, 2)]).tolist()  # both [chunk][rank][e]
    send_splits = [[sum(counts_l[c][r]) for r in range(ep)] for c in range(chunks)]
    recv_splits = [[sum(recv_l[c][s]) for s in range(ep)] for c in range(chunks)]
    expert_rows = [[sum(recv_l[c][s][e] for s in range(ep)) for e in range(local)] for c in range(chunks)]
    rows = order[:sum(map(sum, send_splits))]  # the kept ones, by chunk then expert
    group_perm = group_inv = None
    if ep > 1:
        ids = torch.arange(local, device=dev).repeat(ep)
        group_perm = [torch.argsort(torch.repeat_interleave(ids, recv[:, c, :].reshape(-1),
                                                            output_size=sum(recv_splits[c])), stable=True)
                      for c in range(chunks)]
        group_inv = [torch.empty_like(p).scatter_(0, p, torch.arange(p.numel(), device=dev)) for p in group_perm]
    return DispatchPlan(
        row_token=token[rows], row_assignment=rows, chunk_rows=[sum(s) for s in send_splits],
        send_splits=send_splits, recv_splits=recv_splits, expert_rows=expert_rows,
        expert_counts=list(recv.sum(0).unbind(0)), group_perm=group_perm, group_inv=group_inv,
        sent_per_expert=counts.sum(0).reshape(-1),
        dropped_per_expert=count(flat, num_experts, weights=~keep),
        received_per_expert=recv.sum((0, 1)))


def _regroup(rows: torch.Tensor, perms: list[torch.Tensor] | None, chunk: int) -> torch.Tensor:
    """rows taken in the order of chunk `chunk`'s permutation (a row gather; none on one EP rank)."""
    return rows if perms is None else rows.index_select(0, perms[chunk])


class _Done:
    def wait(self) -> None:
        pass


def _all_to_all(inp: torch.Tensor, out_splits: list[int], in_splits: list[int], group, kind: str, name: str):
    """(received rows, handle): rows still in flight until handle.wait(); no transfer on one rank."""
    if comm.group_size(group) == 1:
        return inp, _Done()
    out = inp.new_empty((sum(out_splits),) + tuple(inp.shape[1:]))
    return out, comm.all_to_all_single(out, inp.contiguous(), group, out_splits=out_splits, in_splits=in_splits,
                                       kind=kind, name=name)


def run_pipeline(chunks: list[torch.Tensor], there: list[tuple[list[int], list[int]]], group, compute,
                 name: str) -> list[torch.Tensor]:
    """Send chunk i's rows with splits there[i] = (in_splits, out_splits), `compute(i, rows)` on arrival,
    send the result back with the reverse splits; return what came back, chunk by chunk."""
    n = len(chunks)

    def dispatch(i):
        ins, outs = there[i]
        return _all_to_all(chunks[i], outs, ins, group, "ep_dispatch", f"{name}.dispatch[{i}]")

    pending, combines = dispatch(0), []
    for i in range(n):
        rows, handle = pending
        if i + 1 < n:
            pending = dispatch(i + 1)  # in flight under chunk i's experts
        handle.wait()
        out = compute(i, rows)
        ins, outs = there[i]
        combines.append(_all_to_all(out, ins, outs, group, "ep_combine", f"{name}.combine[{i}]"))
    back = []
    for rows, handle in combines:
        handle.wait()
        back.append(rows)
    return back


class ExpertsA2A(torch.autograd.Function):
    """Dispatch rows to their experts, compute, combine back — chunk-pipelined; backward the same on dy.

    Forward: x rows (sorted as the plan says) -> the experts' outputs, same rows.
    Backward: dy rows -> dx rows, and the experts' weight gradients, with the same transfers.
    """

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, plan: DispatchPlan, group, add_output_bias: bool, name: str):
        ctx.plan, ctx.group, ctx.name = plan, group, name
        ctx.saved = []
        there = list(zip(plan.send_splits, plan.recv_splits))

        def compute(i, rows):
            with compute_span(f"{name}.fwd.experts[{i}]"):
                grouped = _regroup(rows, plan.group_perm, i)
                y, pre = experts_forward(grouped, plan.expert_rows[i], w1, b1, w2, b2, add_output_bias,
                                         plan.expert_counts[i])
                out = _regroup(y, plan.group_inv, i)
            ctx.saved.append((grouped, pre))
            return out

        ctx.save_for_backward(w1, w2)
        return torch.cat(run_pipeline(list(x.split(plan.chunk_rows)), there, group, compute, f"{name}.fwd"))

    @staticmethod
    def backward(ctx, dy):
        plan, name = ctx.plan, ctx.name
        w1, w2 = ctx.saved_tensors
        grads = [torch.zeros(shape, dtype=w1.dtype, device=w1.device)
                 for shape in (w1.shape, w1.shape[:2], w2.shape, w2.shape[:2])]
        there = list(zip(plan.send_splits, plan.recv_splits))

        def compute(i, rows):
            with compute_span(f"{name}.bwd.experts[{i}]"):
                grouped, pre = ctx.saved[i]
                dx = experts_backward(_regroup(rows, plan.group_perm, i), grouped, pre, plan.expert_rows[i], w1, w2,
                                      grads, plan.expert_counts[i])
                out = _regroup(dx, plan.group_inv, i)
            return out

        dx = torch.cat(run_pipeline(list(dy.contiguous().split(plan.chunk_rows)), there, ctx.group, compute,
                                    f"{name}.bwd"))
        ctx.saved = None
        return dx, grads[0], grads[1], grads[2], grads[3], None, None, None, None
