"""The all-gather schedule (`overlap="bulk"`): every K/V block is sent to every rank at the start of the pass, and
each block's attention hides the transfers of all the blocks after it.

In the ring a hop can start only once the previous one has arrived, so a hop that runs slower beside a
block's attention than alone is exposed at every step. Here rank r posts, before computing anything, its
K/V to each rank r+i (i = 1 … P−1, in that order: rank r+i attends it at its step i) and the matching
receives from each r−i, then attends its own block and the others as they land: step i's block has i
blocks of attention to arrive behind, not one. Backward keeps the block of step 1 from forward (as the
ring does), re-gathers the others the same way at its start, and sends each block's dK/dV part straight to
the block's owner right after computing it (kind `cp_kv`, fp32); the owner computes its own block last and
then adds the parts that came in behind its other steps. A block nobody attends (causal, contiguous layout:
an earlier rank never sees a later rank's keys) does not travel; both ends know it from the block plan.

`prefetch` (ContextParallelConfig) bounds how far ahead blocks are requested: before step i computes,
the exchanges of every step up to i + prefetch are posted (None: all at the start). gloo interleaves
transfers in flight at once, so with all of them posted the block needed first shares the link with
P−2 others; a smaller prefetch trades that against fewer blocks of attention to hide behind.

Memory: forward holds up to all P−1 received K/V blocks at once (the whole sequence's K/V, as the
all-gather context parallelism of Llama 3 does; prefetch + 1 at most with a prefetch), backward as
many again and P−1 fp32 dK/dV parts of the own block; the ring holds two K/V blocks and one accumulator. Each step of the two schedules computes the same
blocks (`ring.attend` and `ring.fold`, `ring.backward_step`); only when their data arrives differs.
"""

from __future__ import annotations

import torch

from ..runtime import comm
from ..runtime.recorder import compute_span
from .ring import Ring, add_parts, attend, backward_step, fold, join


def _post_kv(ring: Ring, kv, steps, phase: str, sends: list, arriving: dict) -> None:
    """Send `kv` (this rank's block) to every rank that attends it at one of `steps` and post the receive of
    the block this rank attends at that step into `arriving` {step: (receive handle, tensors)}. Every rank
    posts exchange i at the same point of its pass (the rule depends only on i, P and prefetch), so under
    NCCL each exchange is one matched permutation of sends and receives."""
    for i in steps:
        dst, src = (ring.rank + i) % ring.size, (ring.rank - i) % ring.size
        out = [(t, dst) for t in kv] if ring.attends(dst, ring.rank) else []
        incoming = [torch.empty_like(t) for t in kv] if ring.attends(ring.rank, src) else []
        received, sent = comm.ring_exchange(out, [(t, src) for t in incoming], ring.group, kind="cp_kv",
                                            name=f"{ring.name}.{phase}.kv[{i}]")
        sends.append(sent)
        if incoming:
            arriving[i] = (received, incoming)


class _Requests:
    """The K/V exchanges of one pass, posted `prefetch` steps ahead of the step that attends them (all at once
    when prefetch is None): before step i computes, every exchange up to step i + prefetch has been posted."""

    def __init__(self, ring: Ring, kv, first: int, phase: str, sends: list) -> None:
        self.ring, self.kv, self.phase, self.sends = ring, kv, phase, sends
        self.depth = ring.size if ring.prefetch is None else ring.prefetch
        self.arriving: dict = {}
        self.posted = first - 1
        self.ahead(first - 1)

    def ahead(self, step: int) -> None:
        """Post the exchanges up to step `step` + prefetch (those not posted yet)."""
        last = min(step + self.depth, self.ring.size - 1)
        _post_kv(self.ring, self.kv, range(self.posted + 1, last + 1), self.phase, self.sends, self.arriving)
        self.posted = max(self.posted, last)

    def block(self, step: int):
        """The block step `step` attends (waited for), or None where it attends nothing; posts the next ones."""
        got = self.arriving.pop(step, None)
        if got is not None:
            got[0].wait()
        self.ahead(step)
        return None if got is None else got[1]


def gather_forward(ring: Ring, q, k, v):
    """(out fp32, lse fp32, rests, the K/V block of step 1) as `ring.ring_forward` returns them."""
    sends: list = []
    kv = [k.contiguous(), v.contiguous()]
    requests = _Requests(ring, kv, 1, "fwd", sends)
    out = lse = first = None
    rests = []
    for i in range(ring.size):
        block = kv if i == 0 else requests.block(i)
        if i == 1:
            first = block  # kept for backward, which starts on it
        if block is None:  # nothing of that block is attended here
            rests.append([])
            continue
        with compute_span(f"{ring.name}.fwd[{i}]"):
            parts, step_rests = attend(ring, i, q, block)
        out, lse = fold(ring, i, parts, out, lse)
        rests.append(step_rests)
    join(sends)
    return out, lse, rests, first


def gather_backward(ring: Ring, dout, q, k, v, out, lse, rests, first):
    """(dq, dk, dv) in fp32 for the local q, k, v, as `ring.ring_backward` returns them."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    sends: list = []
    requests = _Requests(ring, [k.contiguous(), v.contiguous()], 2, "bwd", sends)  # step 1's block: `first`
    parts = []  # this rank's block's dK/dV parts from the ranks that attended it: (handle, tensors)
    for i in range(1, ring.size):
        block = first if i == 1 else requests.block(i)
        owner, attender = (ring.rank - i) % ring.size, (ring.rank + i) % ring.size
        out_parts = []
        if block is not None:
            with compute_span(f"{ring.name}.bwd[{i}]"):
                dkv = backward_step(ring, i, dout, q, block, out, lse, rests[i], dq)
            out_parts = [(t, owner) for t in dkv]
        incoming = []
        if ring.attends(attender, ring.rank):
            incoming = [torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in (k, v)]
        received, sent = comm.ring_exchange(out_parts, [(t, attender) for t in incoming], ring.group,
                                            kind="cp_kv", name=f"{ring.name}.bwd.dkv[{i}]")
        sends.append(sent)
        if incoming:
            parts.append((received, incoming))
    with compute_span(f"{ring.name}.bwd[0]"):
        dkv = backward_step(ring, 0, dout, q, [k, v], out, lse, rests[0], dq)
    for handle, part in parts:
        handle.wait()
        add_parts(ring, dkv, [part], "bwd.parts")
    join(sends)
    return dq, dkv[0], dkv[1]
