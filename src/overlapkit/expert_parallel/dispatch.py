"""Chunked dispatch -> expert GEMMs -> combine at exact split sizes: the all-to-alls of chunks i+1 and i-1 in flight while chunk i computes.

`plan_dispatch` sorts a rank's (token, expert) assignments by chunk and expert, applies the
capacity factor, and exchanges the row counts once (the forward's one host sync); `ExpertsA2A`
is the autograd Function that runs the pipeline in the same issue order on every rank,
d0, d1, [experts 0], c0, d2, [experts 1], c1, ..., forward and backward. chunks=1 is the
sequential reference. docs/expert_parallel.md has the buffers, the order and the exact path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runtime import comm
from ..runtime.recorder import compute_span
from ..runtime.tuning import timed
from . import pairwise
from .experts import Groups, count, device_ints, experts_backward, experts_forward, fill_grads, grouped_on

RANKS = "ranks"
"""`chunks="ranks"`: a chunk per source rank (pairwise.py) instead of token chunks."""


@dataclass
class DispatchPlan:
    """Where every send row of one forward goes, and how the received rows group, chunk by chunk (or, with
    chunks="ranks", source rank by source rank)."""

    row_token: torch.Tensor
    """[rows] the local token each send row carries (rows sorted by chunk, then expert)."""
    row_assignment: torch.Tensor
    """[rows] the flat (token * top_k + choice) assignment of each send row."""
    schedule: int | str
    """The chunks the plan was made for: a token-chunk count, or "ranks"."""
    chunk_rows: list[int]
    """Send rows of each token chunk (they are consecutive, chunk by chunk); one chunk under "ranks"."""
    send_splits: list[list[int]] | None
    """[chunk][ep rank] rows this rank sends to each EP rank (None on one EP rank: nothing is sent)."""
    recv_splits: list[list[int]] | None
    """[chunk][ep rank] rows this rank receives from each EP rank (None on one EP rank)."""
    recv_rows: list[int]
    """Rows this rank's experts compute, per chunk (consecutive in the receive buffer)."""
    groups: list[Groups]
    """[chunk] how its received rows, grouped by expert, split into local experts ([source rank] under "ranks",
    where a source's rows arrive grouped by expert already)."""
    recv_perm: torch.Tensor | None
    """[all received rows] the receive-buffer row of each row once grouped by expert within its chunk
    (rows arrive by source rank, then expert); None on one EP rank, where they arrive grouped."""
    assignments: int
    """tokens * top_k: the (token, choice) slots the outputs go back to."""
    dropless: bool
    """Every (token, choice) assignment has a row (nothing was dropped by a capacity)."""
    sent_per_expert: torch.Tensor
    """[num_experts] assignments of this rank's tokens each expert takes (after drops)."""
    dropped_per_expert: torch.Tensor | None
    """[num_experts] assignments of this rank's tokens dropped for lack of capacity (None: dropless)."""
    received_per_expert: torch.Tensor
    """[local experts] rows this rank's experts computed, from every rank."""
    announced: list[int] | None = None
    """[ep rank] the number each EP rank sent along with its counts (`plan_dispatch(announce=)`); None if not asked."""

    @property
    def expert_rows(self) -> list[list[int]]:
        """[chunk][local expert] rows each local expert computes (host ints: a device sync if not known)."""
        return [g.sizes for g in self.groups]


def chunk_bounds(tokens: int, chunks: int) -> list[int]:
    """Token boundaries of `chunks` near-equal contiguous chunks (some empty when tokens < chunks)."""
    return [c * tokens // chunks for c in range(chunks + 1)]


def chunk_of(index: torch.Tensor, total: int, chunks: int) -> torch.Tensor:
    """The chunk of `chunk_bounds(total, chunks)` each index in [0, total) falls in, on the device
    (index i is in chunk c iff c·total // chunks <= i, i.e. c = ((i + 1)·chunks − 1) // total)."""
    return ((index + 1) * chunks - 1).div_(total, rounding_mode="floor")


def positions(flat_experts: torch.Tensor, top_k: int, num_experts: int,
              per_expert: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(each assignment's place in its expert's queue, assignments per expert): every token's first choice
    before any second choice, earlier tokens first — the order a capacity admits them in. `per_expert`: the
    counts if the caller has them (the router's)."""
    n = flat_experts.numel()
    tokens = n // top_k
    choice_major = flat_experts.view(tokens, top_k).t().reshape(-1)
    order = torch.argsort(choice_major, stable=True)
    if per_expert is None:
        per_expert = count(choice_major, num_experts)
    start = per_expert.cumsum(0) - per_expert
    place = torch.arange(n, device=flat_experts.device) - start[choice_major[order]]
    queued = torch.empty_like(place).scatter_(0, order, place)
    return queued.view(top_k, tokens).t().reshape(-1), per_expert


def constant(cache: dict | None, key: tuple, make) -> torch.Tensor:
    """make(): a tensor that depends on shapes and the device only, made once per key in `cache` (the layer's:
    per-call host work and kernels saved). Made outside inference mode and autograd, so any later call can use
    it; None: made every call."""
    t = None if cache is None else cache.get(key)
    if t is None:
        with torch.inference_mode(False), torch.no_grad():
            t = make()
        if cache is not None:
            if len(cache) >= 32:  # token counts that change every call: keep the memory bounded
                cache.clear()
            cache[key] = t
    return t


def _receive_layout(recv: torch.Tensor, total: int, dev, cache: dict | None = None) -> torch.Tensor:
    """Permutation taking rows received by (chunk, source rank, expert) to (chunk, expert, source rank)."""
    chunks, ep, local = recv.shape

    def make():
        c, s, e = torch.meshgrid(torch.arange(chunks), torch.arange(ep), torch.arange(local), indexing="ij")
        return device_ints(((c * local + e) * ep + s).reshape(-1).tolist(), dev)  # host-made: a constant pattern

    key = constant(cache, ("receive_layout", chunks, ep, local, str(dev)), make)
    return torch.argsort(torch.repeat_interleave(key, recv.reshape(-1), output_size=total), stable=True)


def plan_dispatch(experts: torch.Tensor, num_experts: int, chunks: int, capacity: int | None, group,
                  name: str, per_expert: torch.Tensor | None = None, cache: dict | None = None,
                  announce: int | None = None) -> DispatchPlan:
    """Collective over the EP group (one all-to-all of counts, on more than one rank): the plan of one forward.

    `experts` [tokens, top_k] are the router's choices on this rank; `chunks` a count or "ranks";
    `per_expert` [num_experts] their counts if the caller has them (the router counted them for its loss);
    `cache` the layer's dict of shape-only constants (see `constant`); `announce`: a number this rank tells
    every EP rank in the same exchange (each rank's lands in `plan.announced`: a decision all ranks then make
    alike, at no extra collective).
    """
    ep = comm.group_size(group)
    schedule, by_rank = chunks, chunks == RANKS and ep > 1
    chunks = 1 if chunks == RANKS else chunks
    tokens, top_k = experts.shape
    local = num_experts // ep
    dev = experts.device
    flat = experts.reshape(-1)
    keep = None
    if capacity is not None:
        place, per_expert = positions(flat, top_k, num_experts, per_expert)
        keep = place < capacity
    key = flat
    if chunks > 1 and tokens:  # each assignment's chunk, times E: a constant of the shape
        base = constant(cache, ("chunk_base", tokens, top_k, chunks, num_experts, str(dev)), lambda: chunk_of(
            torch.arange(flat.numel(), device=dev).div_(top_k, rounding_mode="floor"), tokens, chunks) * num_experts)
        key = base + flat
    if keep is not None:  # dropped assignments sort after every kept one, into a bin of their own
        key = torch.where(keep, key, chunks * num_experts)
    sorted_key, order = torch.sort(key, stable=True)
    if chunks == 1 and keep is None and per_expert is not None:  # the keys are the experts, counted already
        counts = per_expert.view(1, ep, local)
    else:
        counts = count(key, chunks * num_experts + 1)[:-1].view(chunks, ep, local)
    # Counts first: every rank learns how many rows each peer will send it, chunk by chunk.
    recv, announced, told = counts, None, None
    if ep > 1:
        send = counts.transpose(0, 1).contiguous()  # [dest rank, chunk, local expert]
        if announce is not None:  # one more column: the number every peer is told
            send = torch.cat([send.view(ep, -1), send.new_full((ep, 1), announce)], 1)
        got = torch.empty_like(send)
        comm.all_to_all_single(got, send, group, kind="ep_dispatch", name=f"{name}.fwd.counts", async_op=False)
        if announce is not None:  # read back with the counts below: no host sync of its own
            told = got[:, -1]
            got = got[:, :-1].reshape(ep, chunks, local)
        recv = got.transpose(0, 1)  # [chunk, source rank, local expert]
    elif announce is not None:
        announced = [announce]
    # [piece, local expert]: rows each local expert computes
    per_chunk = recv[0] if by_rank else recv[:, 0] if ep == 1 else recv.sum(1)
    send_splits = recv_splits = expert_rows = None
    if ep > 1 or capacity is not None or not grouped_on(dev):
        # The forward's one host sync (none on a CPU): transfers, and the per-expert loop, need their split
        # sizes on the host; the grouped GEMMs take theirs on the device.
        both = torch.stack([counts, recv])
        if told is None:
            counts_l, recv_l = both.tolist()  # both [chunk][rank][e]
        else:
            read = torch.cat([both.reshape(-1), told]).tolist()
            announced, rows = read[both.numel():], iter(read[:both.numel()])
            counts_l, recv_l = ([[[next(rows) for _ in range(local)] for _ in range(ep)] for _ in range(chunks)]
                                for _ in range(2))
        send_splits = [[sum(counts_l[c][r]) for r in range(ep)] for c in range(chunks)]
        recv_splits = [[sum(recv_l[c][s]) for s in range(ep)] for c in range(chunks)]
        expert_rows = [[sum(recv_l[c][s][e] for s in range(ep)) for e in range(local)] for c in range(chunks)]
        chunk_rows = [sum(s) for s in send_splits]
        recv_rows = recv_splits[0] if by_rank else [sum(s) for s in recv_splits]
        if by_rank:
            expert_rows = recv_l[0]
    else:  # one rank, dropless: chunk c holds exactly its tokens' assignments
        bounds = chunk_bounds(tokens, chunks)
        chunk_rows = recv_rows = [(bounds[c + 1] - bounds[c]) * top_k for c in range(chunks)]
    rows = order[:sum(chunk_rows)] if keep is not None else order  # the kept ones, by chunk then expert
    total = sum(recv_rows)
    pieces = ep if by_rank else chunks
    ends = per_chunk.cumsum(1, dtype=torch.int32)
    expert = None
    if grouped_on(dev) and ep == 1:  # each row's expert, for the biases: the sorted keys say it already
        expert = sorted_key[:total] if chunks == 1 else sorted_key[:total].remainder(num_experts)
    elif grouped_on(dev):  # received rows: their experts from the received counts (the loop needs none)
        ids = torch.arange(local, device=dev)
        expert = torch.repeat_interleave(ids if pieces == 1 else ids.repeat(pieces), per_chunk.reshape(-1),
                                         output_size=total)
    groups, off = [], 0
    for c in range(pieces):  # one piece: the whole tensors, no views to make
        one = pieces == 1
        groups.append(Groups(per_chunk[0 if one else c], recv_rows[c], expert_rows[c] if expert_rows else None,
                             ends[0 if one else c],
                             expert if one or expert is None else expert[off:off + recv_rows[c]]))
        off += recv_rows[c]
    sent = counts.reshape(-1) if chunks == 1 else counts.sum(0).reshape(-1)
    dropped = None if keep is None else per_expert - sent  # None: nothing dropped (no kernel to say so)
    return DispatchPlan(
        row_token=rows.div(top_k, rounding_mode="floor"), row_assignment=rows, schedule=schedule, chunk_rows=chunk_rows,
        send_splits=send_splits if ep > 1 else None, recv_splits=recv_splits if ep > 1 else None,
        recv_rows=recv_rows, groups=groups,
        recv_perm=_receive_layout(recv, total, dev, cache) if ep > 1 and not by_rank else None,
        assignments=flat.numel(), dropless=keep is None, sent_per_expert=sent, dropped_per_expert=dropped,
        received_per_expert=per_chunk[0] if pieces == 1 else per_chunk.sum(0), announced=announced)


class _Done:
    def wait(self) -> None:
        pass


DONE = _Done()
"""The handle of a transfer that did not happen (one EP rank)."""


def schedule(chunks: int, dispatch, compute, combine) -> None:
    """Run d0, d1, [compute 0], c0, d2, [compute 1], c1, ...: `dispatch(i)` -> (rows, handle) issues chunk
    i's dispatch, `compute(i, rows)` -> out runs once its rows landed, `combine(i, out)` -> handle sends
    the result back. Every combine is waited for at the end, none before (they hide behind later chunks)."""
    combines = []
    pending = dispatch(0) if chunks else None
    for i in range(chunks):
        rows, handle = pending
        if i + 1 < chunks:
            pending = dispatch(i + 1)  # in flight under chunk i's experts
        handle.wait()
        combines.append(combine(i, compute(i, rows)))
    for handle in combines:
        handle.wait()


def run_pipeline(rows: torch.Tensor, plan: DispatchPlan, group, compute, name: str, width: int) -> torch.Tensor:
    """Send the rows (in send order, chunk after chunk) to their experts, `compute(i, grouped rows)` each
    chunk on arrival (rows grouped by local expert), return the results (`width` columns) in send order."""
    n = len(plan.chunk_rows)
    if plan.send_splits is not None and plan.recv_perm is None:  # chunks="ranks"
        return _run_by_rank(rows, plan, group, compute, name, width)
    if plan.send_splits is None:  # one EP rank: the rows are already grouped by expert, nothing travels
        outs, off = [], 0
        for i, r in enumerate(plan.chunk_rows):
            outs.append(compute(i, rows[off:off + r]))
            off += r
        return outs[0] if n == 1 else torch.cat(outs)
    soff = [0]
    roff = [0]
    for i in range(n):
        soff.append(soff[-1] + plan.chunk_rows[i])
        roff.append(roff[-1] + plan.recv_rows[i])
    received = rows.new_empty((roff[-1],) + tuple(rows.shape[1:]))
    back = rows.new_empty((roff[-1], width))
    result = rows.new_empty((soff[-1], width))

    def dispatch(i):
        out = received[roff[i]:roff[i + 1]]
        return out, comm.all_to_all_single(out, rows[soff[i]:soff[i + 1]], group, out_splits=plan.recv_splits[i],
                                           in_splits=plan.send_splits[i], kind="ep_dispatch", name=f"{name}.dispatch[{i}]")

    def run(i, got):
        perm = plan.recv_perm[roff[i]:roff[i + 1]]
        back.index_copy_(0, perm, compute(i, received.index_select(0, perm)))
        return back[roff[i]:roff[i + 1]]

    def combine(i, out):
        return comm.all_to_all_single(result[soff[i]:soff[i + 1]], out, group, out_splits=plan.send_splits[i],
                                      in_splits=plan.recv_splits[i], kind="ep_combine", name=f"{name}.combine[{i}]")

    schedule(n, dispatch, run, combine)
    return result


def _run_by_rank(rows: torch.Tensor, plan: DispatchPlan, group, compute, name: str, width: int) -> torch.Tensor:
    """run_pipeline under chunks="ranks": pairwise rounds, a source's rows computed as they arrive."""
    ep, me = comm.group_size(group), comm.group_rank(group)
    soff, roff = pairwise.offsets(plan.send_splits[0]), pairwise.offsets(plan.recv_splits[0])
    received = rows.new_empty((roff[-1],) + tuple(rows.shape[1:]))
    result = rows.new_empty((soff[-1], width))

    def run(src, got, out):
        y = compute(src, got)
        return y if out is None else out.copy_(y)

    pairwise.run(me, ep, group, [rows[soff[d]:soff[d + 1]] for d in range(ep)],
                 [received[roff[s]:roff[s + 1]] for s in range(ep)], [result[soff[d]:soff[d + 1]] for d in range(ep)],
                 run, name)
    return result


def _slots(plan: DispatchPlan, rows: torch.Tensor, assignments: int) -> torch.Tensor:
    """[assignments, width]: each row in its (token, choice) slot; slots of dropped assignments 0."""
    make = rows.new_empty if plan.dropless else rows.new_zeros
    return make((assignments, rows.shape[1])).index_copy_(0, plan.row_assignment, rows)


def token_grads(plan: DispatchPlan, rows: torch.Tensor, tokens: int) -> torch.Tensor:
    """[tokens, width]: the gradients of the send rows put in their (token, choice) slots, each token's
    slots summed in a fixed order (no atomics)."""
    slots = _slots(plan, rows, plan.assignments)
    return slots if plan.assignments == tokens else slots.view(tokens, -1, slots.shape[1]).sum(1)


class ExpertsA2A(torch.autograd.Function):
    """x [tokens, hidden] -> [tokens * top_k, hidden], each (token, choice)'s expert output in its slot (0 if
    dropped): gather, dispatch, compute, combine — chunk-pipelined; backward the same on the slots' gradients.
    """

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, plan: DispatchPlan, group, add_output_bias: bool, name: str, trial=None):
        ctx.plan, ctx.group, ctx.name, ctx.trial, ctx.tokens = plan, group, name, trial, x.shape[0]
        ctx.saved = {}  # by chunk (or source rank)

        def compute(i, grouped):
            with compute_span(f"{name}.fwd.experts[{i}]"):
                y, pre = experts_forward(grouped, plan.groups[i], w1, b1, w2, b2, add_output_bias)
            ctx.saved[i] = (grouped, pre)
            return y

        ctx.save_for_backward(w1, w2)
        y = run_pipeline(x.index_select(0, plan.row_token), plan, group, compute, f"{name}.fwd", w2.shape[1])
        return _slots(plan, y, plan.assignments)

    @staticmethod
    def backward(ctx, dslots):
        with timed(ctx.trial, "backward"):  # auto's trials time it; nothing once decided
            return ExpertsA2A._backward(ctx, dslots)

    @staticmethod
    def _backward(ctx, dslots):
        plan, name = ctx.plan, ctx.name
        w1, w2 = ctx.saved_tensors
        grads = [None] * 4

        def compute(i, rows):
            with compute_span(f"{name}.bwd.experts[{i}]"):
                grouped, pre = ctx.saved[i]
                return experts_backward(rows, grouped, pre, plan.groups[i], w1, w2, grads)

        drows = dslots.contiguous().index_select(0, plan.row_assignment)
        dx = run_pipeline(drows, plan, ctx.group, compute, f"{name}.bwd", w1.shape[2])
        ctx.saved = None
        dx2 = token_grads(plan, dx, ctx.tokens)
        fill_grads(grads, w1, w2)  # experts no chunk reached
        return dx2, grads[0], grads[1], grads[2], grads[3], None, None, None, None, None

