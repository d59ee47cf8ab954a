"""The ring schedule: the next key/value block is in flight around the CP ring while this one's attention runs.

Forward, step i of P on rank r: rank r holds the key/value block of rank (r − i) mod P, sends
it on to r+1 and receives the next from r−1 (one batched `comm.ring_exchange`, kind `cp_kv`),
and meanwhile computes its queries against the block in hand; once the next block is in and sent
on, it folds the result into its running output with the log-sum-exp rule (so the merge is not in
the next hop's way). A step waits only for what it receives; the sends are
joined when the pass ends (their buffers are never written again), because a send completes only
once the successor has posted its receive, and waiting for it would tie every rank to a late
successor as well as to its predecessor. Backward mirrors it: key/value blocks travel the
same way, and beside them the dK/dV accumulator of each block, which every rank adds its part
to before passing it on; after P−1 hops each block's gradient is back with its owner, in time
for the owner's own block, which backward computes last. With
`overlap="none"` every transfer runs after the computation it could have hidden behind (the
sequential reference the benchmark compares with). `gather.py` holds the other schedule,
`overlap="bulk"`: every block sent to every rank at the start of the pass.

Which query rows meet which key columns on a step is decided by `block_plan` from the chunk
grid of `split`: causal diagonals are computed with a causal mask, chunks wholly in the
future are skipped and never computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runtime import comm
from ..runtime.recorder import compute_span
from .kernels import block_backward, block_forward, merge
from .split import chunks_of


@dataclass(frozen=True)
class Call:
    """One block-attention call: local query rows [q0, q1) against local key rows [k0, k1) of the held block."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


def block_plan(rank: int, src: int, size: int, layout: str, chunk: int, causal: bool) -> list[Call]:
    """The calls rank `rank` makes against the key/value block of rank `src` (local token units)."""
    n = chunk * len(chunks_of(rank, size, layout))
    if not causal:
        return [Call(0, n, 0, n, False)]
    q_chunks, k_chunks = chunks_of(rank, size, layout), chunks_of(src, size, layout)
    if q_chunks == k_chunks:
        # Local positions increase along the local sequence, so one causal mask over all of it is exact.
        return [Call(0, n, 0, n, True)]
    calls: list[Call] = []
    for qi, qc in enumerate(q_chunks):
        # Ranks own disjoint chunks of one grid: a key chunk is wholly before this query chunk or after it.
        seen = [ki for ki, kc in enumerate(k_chunks) if kc < qc]
        if not seen:
            continue
        if seen != list(range(seen[0], seen[-1] + 1)):
            raise AssertionError(f"key chunks {seen} of rank {src} are not contiguous in its local order")
        k0, k1 = seen[0] * chunk, (seen[-1] + 1) * chunk
        last = calls[-1] if calls else None
        if last is not None and last.q1 == qi * chunk and (last.k0, last.k1) == (k0, k1):
            calls[-1] = Call(last.q0, (qi + 1) * chunk, k0, k1, False)  # same keys: one wider call
        else:
            calls.append(Call(qi * chunk, (qi + 1) * chunk, k0, k1, False))
    return calls


@dataclass(frozen=True)
class Ring:
    """Everything about this rank's place in the ring that the forward and backward schedules share."""

    group: object
    rank: int
    size: int
    layout: str
    chunk: int
    causal: bool
    scale: float
    kernel: str
    overlap: str
    name: str
    prefetch: int | None = None
    """The all-gather schedule's K/V blocks in flight at once (None: all); see ContextParallelConfig."""

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.size

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.size

    def plan(self, step: int) -> list[Call]:
        return block_plan(self.rank, (self.rank - step) % self.size, self.size, self.layout, self.chunk, self.causal)

    def attends(self, rank: int, src: int) -> bool:
        """Whether rank `rank`'s queries meet any key of rank `src`'s block (under a causal mask with the
        contiguous layout an earlier rank never sees a later one's keys): every rank can tell, so a block
        nobody attends need not travel."""
        return bool(block_plan(rank, src, self.size, self.layout, self.chunk, self.causal))

    def pass_on(self, tensors, label: str, sends: list) -> tuple[comm.Handle, list[torch.Tensor]]:
        """Send `tensors` to the next rank and receive the same shapes from the previous one: (the receive's
        handle, the incoming tensors). The send's handle goes to `sends`, to be joined when the pass ends
        (or at once, with the receive, in the sequential schedule)."""
        incoming = [torch.empty_like(t) for t in tensors]
        received, sent = comm.ring_exchange([(t, self.next) for t in tensors], [(t, self.prev) for t in incoming],
                                            self.group, kind="cp_kv", name=f"{self.name}.{label}")
        if self.overlap == "none":
            received.wait()
            sent.wait()
        else:
            sends.append(sent)
        return received, incoming


def join(sends: list) -> None:
    """Wait for every send of a pass (their buffers are never written before the pass ends)."""
    for h in sends:
        h.wait()


def ring_forward(ring: Ring, q, k, v):
    """(out fp32, lse fp32, rests, the K/V block received first) of the local queries against every rank's keys
    and values. That block (rank r−1's) is kept for backward, which starts with it (see `ring_backward`).

    A step attends its block, waits for the next one, sends that on at once and only then merges its own
    result into the running output: the hop leaves a merge earlier than if the merge came first."""
    out = lse = first = handle = incoming = None
    rests, sends = [], []
    kv = [k.contiguous(), v.contiguous()]
    pipelined = ring.overlap == "pipelined"
    if pipelined and ring.size > 1:
        handle, incoming = ring.pass_on(kv, "fwd.kv[0]", sends)
    for i in range(ring.size):
        with compute_span(f"{ring.name}.fwd[{i}]"):
            parts, step_rests = attend(ring, i, q, kv)
        rests.append(step_rests)
        if i < ring.size - 1:
            if not pipelined:  # the sequential reference: the hop after the block, waited at once
                handle, incoming = ring.pass_on(kv, f"fwd.kv[{i}]", sends)
            handle.wait()
            kv = incoming
            first = incoming if first is None else first
            if pipelined and i + 1 < ring.size - 1:
                handle, incoming = ring.pass_on(kv, f"fwd.kv[{i + 1}]", sends)
        out, lse = fold(ring, i, parts, out, lse)
    join(sends)
    return out, lse, rests, first


def attend(ring: Ring, step: int, q, kv) -> tuple[list, list]:
    """([(call, out, lse)] of the local queries against the held block, unmerged; the kernels' rests)."""
    parts, rests = [], []
    for c in ring.plan(step):
        o, l, rest = block_forward(q[:, :, c.q0:c.q1], kv[0][:, :, c.k0:c.k1], kv[1][:, :, c.k0:c.k1],
                                   c.causal, ring.scale, ring.kernel)
        parts.append((c, o, l))
        rests.append(rest)
    return parts, rests


def fold(ring: Ring, step: int, parts: list, out, lse):
    """Merge `attend`'s parts into the running (out, lse); step 0, the own block every row sees, starts them."""
    for c, o, l in parts:
        if out is None:
            out, lse = o, l
            continue
        with compute_span(f"{ring.name}.fwd[{step}].merge"):  # a span of its own: its share of a step
            merge(out[:, :, c.q0:c.q1], lse[:, :, c.q0:c.q1], o, l)
    return out, lse


def ring_backward(ring: Ring, dout, q, k, v, out, lse, rests, first):
    """(dq, dk, dv) in fp32 for the local q, k, v.

    Steps run over the other ranks' blocks first (starting with `first`, rank r−1's, kept from
    forward, so nothing has to arrive before the first computation) and the rank's own block
    last: the dK/dV accumulator of a block travels r+1 → … → r−1 → r, each rank adding its part,
    and its final hop home lands while the owner computes its own block — so no hop is left
    after the last computation.
    """
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    acc_handle = acc = None
    sends = []
    kv = first
    for step in range(1, ring.size):
        kv_handle = None
        if ring.overlap == "pipelined" and step < ring.size - 1:
            kv_handle, kv_in = ring.pass_on(kv, f"bwd.kv[{step}]", sends)
        with compute_span(f"{ring.name}.bwd[{step}]"):
            dkv = backward_step(ring, step, dout, q, kv, out, lse, rests[step], dq)
        if acc_handle is not None:
            # The parts of this block's dK/dV from the ranks that held it before this one.
            acc_handle.wait()
            add_parts(ring, dkv, [acc], f"bwd.acc[{step}]")
        if ring.overlap == "none" and step < ring.size - 1:
            kv_handle, kv_in = ring.pass_on(kv, f"bwd.kv[{step}]", sends)
        # After the last of these steps the accumulator goes home: the next rank owns that block.
        acc_handle, acc = ring.pass_on(dkv, f"bwd.dkv[{step}]", sends)
        if kv_handle is not None:
            kv_handle.wait()
            kv = kv_in
    with compute_span(f"{ring.name}.bwd[0]"):
        dkv = backward_step(ring, 0, dout, q, [k, v], out, lse, rests[0], dq)
    if acc_handle is not None:
        acc_handle.wait()
        add_parts(ring, dkv, [acc], "bwd.acc[0]")
    join(sends)
    return dq, dkv[0], dkv[1]


def add_parts(ring: Ring, dkv: list, parts: list, label: str) -> None:
    """dkv += each (dk, dv) of `parts`, in place. A compute span of its own: a transfer still in flight runs
    beside these adds (counting them as waiting would blame the transfer for the rank's own work)."""
    with compute_span(f"{ring.name}.{label}"):
        for dk, dv in parts:
            dkv[0] += dk
            dkv[1] += dv


def backward_step(ring: Ring, step: int, dout, q, kv, out, lse, rests, dq) -> list[torch.Tensor]:
    """Add the held block's part of dq into `dq`; return its (dk, dv) parts in fp32."""
    dkv = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in kv]
    for c, rest in zip(ring.plan(step), rests):
        s = slice(c.q0, c.q1)
        dq_b, dk_b, dv_b = block_backward(dout[:, :, s], q[:, :, s], kv[0][:, :, c.k0:c.k1], kv[1][:, :, c.k0:c.k1],
                                          out[:, :, s], lse[:, :, s], c.causal, ring.scale, ring.kernel, rest)
        dq[:, :, s] += dq_b
        dkv[0][:, :, c.k0:c.k1] += dk_b
        dkv[1][:, :, c.k0:c.k1] += dv_b
    return dkv
