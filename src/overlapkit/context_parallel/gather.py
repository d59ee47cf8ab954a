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

Memory: forward holds all P−1 received K/V blocks at once (the whole sequence's K/V, as the all-gather
context parallelism of Llama 3 does), backward P−1 again and P−1 fp32 dK/dV parts of the own block;
the ring holds two K/V blocks and one accumulator. Each step of the two schedules computes the same
blocks (`ring.attend` and `ring.fold`, `ring.backward_step`); only when their data arrives differs.
"""

from __future__ import annotations

import torch

from ..runtime import comm
from ..runtime.recorder import compute_span
from .ring import Ring, attend, backward_step, fold, join


def _post_kv(ring: Ring, kv, steps, phase: str, sends: list) -> dict:
    """Send `kv` (this rank's block) to every rank that attends it at one of `steps` and post the receive of
    the block this rank attends at that step: {step: (receive handle, tensors)} (None where none comes)."""
    arriving = {}
    for i in steps:
        dst, src = (ring.rank + i) % ring.size, (ring.rank - i) % ring.size
        out = [(t, dst) for t in kv] if ring.attends(dst, ring.rank) else []
        incoming = [torch.empty_like(t) for t in kv] if ring.attends(ring.rank, src) else []
        received, sent = comm.ring_exchange(out, [(t, src) for t in incoming], ring.group, kind="cp_kv",
                                            name=f"{ring.name}.{phase}.kv[{i}]")
        sends.append(sent)
        arriving[i] = (received, incoming) if incoming else None
    return arriving


def _arrived(arriving: dict, step: int):
    got = arriving.get(step)
    if got is None:
        return None
    got[0].wait()
    return got[1]


def gather_forward(ring: Ring, q, k, v):
    """(out fp32, lse fp32, rests, the K/V block of step 1) as `ring.ring_forward` returns them."""
    sends: list = []
    kv = [k.contiguous(), v.contiguous()]
    arriving = _post_kv(ring, kv, range(1, ring.size), "fwd", sends)
    out = lse = None
    rests = []
    for i in range(ring.size):
        block = kv if i == 0 else _arrived(arriving, i)
        if block is None:  # nothing of that block is attended here
            rests.append([])
            continue
        with compute_span(f"{ring.name}.fwd[{i}]"):
            parts, step_rests = attend(ring, i, q, block)
        out, lse = fold(ring, i, parts, out, lse)
        rests.append(step_rests)
    join(sends)
    return out, lse, rests, _arrived(arriving, 1)


def gather_backward(ring: Ring, dout, q, k, v, out, lse, rests, first):
    """(dq, dk, dv) in fp32 for the local q, k, v, as `ring.ring_backward` returns them."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    sends: list = []
    arriving = _post_kv(ring, [k.contiguous(), v.contiguous()], range(2, ring.size), "bwd", sends)
    parts = []  # this rank's block's dK/dV parts from the ranks that attended it: (handle, tensors)
    for i in range(1, ring.size):
        block = first if i == 1 else _arrived(arriving, i)
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
    for handle, (dk, dv) in parts:
        handle.wait()
        dkv[0] += dk
        dkv[1] += dv
    join(sends)
    return dq, dkv[0], dkv[1]
