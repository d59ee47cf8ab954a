"""Pipelining by source rank: EP−1 point-to-point rounds whose transfers hide behind the experts of the rows that came before.

With `chunks="ranks"` the rows of each source rank are a chunk. Round j of EP−1 on rank r sends the
rows for rank r+j and receives those of rank r−j, while the experts compute the rows that arrived the
round before (the own rows first: they travel nowhere); each source's results go straight back to it.
That is as many messages as one all-to-all, where token chunks multiply them (each chunk's all-to-all
pays every peer's latency again).

Issue order, one structure on every rank:
    D1, [own rows], D2, [rows of r−1], C1, D3, [rows of r−2], C2, …, [rows of r−EP+1], C_EP−1
Ranks a and b exchange their dispatch at round (b − a) mod EP and their combine at round (a − b) mod EP,
on both ends, so every pair posts its messages in the same order at both ends (what gloo's tag queues
and NCCL's issue-order matching need). A round waits only for what it receives; sends are joined at the
end (a send completes only once the peer posted its receive: waiting for it would tie ranks together).
"""

from __future__ import annotations

import torch

from ..runtime import comm


def run(me: int, ep: int, group, send: list[torch.Tensor], recv: list[torch.Tensor], result: list[torch.Tensor],
        compute, name: str) -> None:
    """send[d]: the rows for rank d (send[me]: the own rows); recv[s]: the buffer for the rows from rank s;
    result[d]: where the results of the rows sent to d land. `compute(s, rows, out)` returns the results of
    source s's rows (written into `out` when it is given: the own rows' results)."""
    sends = []

    def exchange(out_rows, dst, in_rows, src, kind, label):
        # An empty message is skipped on both ends: the sender's size is the receiver's (the counts said so).
        received, sent = comm.ring_exchange([(out_rows, dst)] if out_rows.numel() else [],
                                            [(in_rows, src)] if in_rows.numel() else [], group, kind=kind, name=label)
        sends.append(sent)
        return received

    def dispatch(j):
        dst, src = (me + j) % ep, (me - j) % ep
        return exchange(send[dst], dst, recv[src], src, "ep_dispatch", f"{name}.dispatch[{j}]")

    pending = dispatch(1) if ep > 1 else None
    compute(me, send[me], result[me])
    combines = []
    for j in range(1, ep):
        handle = pending
        if j + 1 < ep:
            pending = dispatch(j + 1)  # in flight under the rows that just arrived
        handle.wait()
        src, home = (me - j) % ep, (me + j) % ep
        out = compute(src, recv[src], None)
        combines.append(exchange(out, src, result[home], home, "ep_combine", f"{name}.combine[{j}]"))
    for handle in combines:
        handle.wait()
    for handle in sends:
        handle.wait()


def offsets(sizes: list[int]) -> list[int]:
    """[0, sizes[0], sizes[0] + sizes[1], …]: where each rank's rows start."""
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out
