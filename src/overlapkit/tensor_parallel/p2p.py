"""The "p2p" transport of pipelined tensor parallelism: chunks move by batched send/recv while GEMMs run.

All-gather side: a ring. Each rank forwards to its next neighbour the chunk it received from
its previous one, so at step t it holds the shard of rank (r - t); the GEMM of a chunk runs as
soon as that chunk has landed, while the next chunk is in flight. The local shard needs no
transfer, so its GEMM runs first, under the first transfer.

Reduce-scatter side: a shifted exchange. At step t each rank computes the partial product of
the rows that rank (r + t) owns and sends it there, while it computes the next step's partial;
its own rows come last, under the last transfer. The partials travel in the input precision
and are summed once, in fp32 for bf16/fp16 (one rounding instead of one per ring hop).

Transfers go through `overlapkit.runtime.comm.exchange`, so the timeline recorder sees every one.
On CUDA they are issued on a side stream: NCCL's stream waits for the stream a transfer is
issued from, and issuing from the compute stream would make each transfer wait for every GEMM
queued before it. Events carry the two real dependencies: a chunk's GEMM waits for its
arrival, a partial's send waits for its GEMM. On CPU, gloo's threads move the data and the
calling thread waits on the work handle.
"""

from __future__ import annotations

import functools
import threading
from typing import Callable

import torch

from ..runtime import comm
from ..runtime import state

Consume = Callable[[slice, torch.Tensor, int], None]
"""consume(rows of the gathered matrix, those rows' data, lane index) — runs one chunk's GEMM."""
Produce = Callable[[slice, "torch.Tensor | None"], torch.Tensor]
"""produce(rows of the full input, out buffer or None) -> that row chunk's partial product."""

_side_streams: dict[torch.device, "torch.cuda.Stream"] = state.cache_dict("tp_p2p.side_streams")
_events: dict[tuple, list] = state.cache_dict("tp_p2p.events")
"""(device, thread) -> events reused by every call's transfers (creating one per transfer cost host time)."""


def side_stream(device: torch.device) -> "torch.cuda.Stream":
    """One transfer stream per device, reused across calls (streams are not free to create)."""
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16/fp16 partial sums (transfer low, reduce high); the input dtype otherwise."""
    return torch.promote_types(dtype, torch.float32)


class _Lane:
    """Where transfers run: a side CUDA stream joined by events, or gloo's own threads on CPU."""

    def __init__(self, device: torch.device, group, kind: str, name: str) -> None:
        self.stream = side_stream(device) if device.type == "cuda" else None
        self.group, self.kind, self.name = group, kind, name
        # Every wait on one of these events is enqueued before the call returns, so the next
        # call (on this thread) may re-record them; inside a CUDA-graph capture they become
        # the graph's edges, the same on every replay.
        self._pool = _events.setdefault((device, threading.get_ident()), []) if self.stream is not None else None
        self._used = 0

    def _event(self) -> "torch.cuda.Event":
        if self._used == len(self._pool):
            self._pool.append(torch.cuda.Event())
        self._used += 1
        return self._pool[self._used - 1]

    def after_compute(self) -> None:
        """Transfers issued from now on see everything the compute stream has produced so far."""
        if self.stream is not None:
            produced = self._event()
            produced.record(torch.cuda.current_stream(self.stream.device))
            self.stream.wait_event(produced)

    def exchange(self, send: tuple[torch.Tensor, int], recv: tuple[torch.Tensor, int], tag: str):
        name = f"{self.name}[{tag}]"
        if self.stream is None:
            return comm.exchange([send], [recv], self.group, kind=self.kind, name=name)
        with torch.cuda.stream(self.stream):
            h = comm.exchange([send], [recv], self.group, kind=self.kind, name=name)
            # The side stream (not the host) waits: later transfers, which may forward what
            # this one receives, queue behind it, and the event marks its arrival.
            h.wait()
            arrived = self._event()
            arrived.record(self.stream)
        return arrived

    def wait(self, transfer) -> None:
        if self.stream is None:
            transfer.wait()
        else:
            torch.cuda.current_stream(self.stream.device).wait_event(transfer)

    def finish(self) -> None:
        """The compute stream waits for every transfer, so buffers freed later are not reused early."""
        if self.stream is not None:
            done = self._event()
            done.record(self.stream)
            torch.cuda.current_stream(self.stream.device).wait_event(done)


@functools.lru_cache(maxsize=256)
def _gather_plan(ws: int, r: int, rows_per_rank: int, k: int) -> tuple:
    """Per ring step, computed once per shape: (t, j, rows of chunk j of step t, rows it forwards into)."""
    u = rows_per_rank // k

    def rows(t: int, j: int) -> slice:
        src = (r - t) % ws
        return slice(src * rows_per_rank + j * u, src * rows_per_rank + (j + 1) * u)

    return tuple((t, j, rows(t, j), rows(t + 1, j) if t + 1 < ws else None) for t in range(ws) for j in range(k))


def gather_and_consume(x: torch.Tensor, consume: Consume, k: int, group, *, name: str,
                       need_gathered: bool) -> torch.Tensor | None:
    """Ring all-gather of the 2-D shard `x` (rows) in ws·k chunks, consuming each as it lands.

    Chunk j of rank i's shard is rows [i·R + j·u, i·R + (j+1)·u) of the gathered matrix
    (R = rows per shard, u = R/k). Returns the gathered matrix if `need_gathered`.
    """
    ws, r = comm.group_size(group), comm.group_rank(group)
    rows_per_rank = x.shape[0]
    u = rows_per_rank // k
    # One rank: the gathered matrix is x itself (copying x into a new buffer cost a whole
    # activation's copy per call; at ws ranks only the local 1/ws is copied, below).
    gathered = x.new_empty((ws * rows_per_rank, x.shape[1])) if ws > 1 else None
    # One rank transfers nothing: no stream hand-over either (two event round trips a call).
    lane = _Lane(x.device, group, "tp_all_gather", name) if ws > 1 else None
    if lane is not None:
        lane.after_compute()
    nxt, prv = (r + 1) % ws, (r - 1) % ws
    pending = {}
    for t, j, here, forward_into in _gather_plan(ws, r, rows_per_rank, k):
        if t == 0:
            data = x if k == 1 else x[j * u:(j + 1) * u]
        else:
            lane.wait(pending.pop((t, j)))
            data = gathered[here]
        if forward_into is not None:
            pending[(t + 1, j)] = lane.exchange((data, nxt), (gathered[forward_into], prv), f"{t + 1}.{j}")
        consume(here, data, 0)
    if lane is not None:
        if need_gathered:
            gathered[r * rows_per_rank:(r + 1) * rows_per_rank].copy_(x)
        lane.finish()
    if not need_gathered:
        return None
    return gathered if gathered is not None else x


def produce_and_reduce_scatter(produce: Produce, total_rows: int, cols: int, k: int, group, *,
                               dtype: torch.dtype, device: torch.device, name: str) -> torch.Tensor:
    """Reduce-scatter over row blocks of partials made chunk by chunk by `produce`; returns [R, cols].

    Rank i owns rows [i·R, (i+1)·R) (R = total_rows / ws). Every step sends one chunk of
    partials to its owner while the next chunk is produced.
    """
    ws, r = comm.group_size(group), comm.group_rank(group)
    R = total_rows // ws
    u = R // k
    # arrived[t] holds what rank (r - t) computed for this rank's rows; slot 0 is the local partial.
    arrived = torch.empty((ws, R, cols), dtype=dtype, device=device)
    lane = _Lane(device, group, "tp_reduce_scatter", name) if ws > 1 else None
    in_flight = []
    for t in range(1, ws):
        dst, src = (r + t) % ws, (r - t) % ws
        for j in range(k):
            partial = produce(slice(dst * R + j * u, dst * R + (j + 1) * u), None)
            if partial.dtype != dtype or partial.shape != (u, cols):
                # A partial of another dtype would land as reinterpreted bytes in `arrived` (a
                # GEMM under torch.autocast gave bf16 into an fp32 buffer): refuse, never sum that.
                raise RuntimeError(f"{name}: a partial product is {partial.dtype} {tuple(partial.shape)}, the "
                                   f"receive buffer {dtype} {(u, cols)}; run the GEMM in the buffer's dtype "
                                   "(the TP layers cast for torch.autocast themselves)")
            lane.after_compute()
            into = arrived[t] if k == 1 else arrived[t, j * u:(j + 1) * u]
            transfer = lane.exchange((partial, dst), (into, src), f"{t}.{j}")
            in_flight.append((transfer, partial))  # keeps the partial alive until it has left
    own = arrived[0]
    for j in range(k):
        produce(slice(r * R + j * u, r * R + (j + 1) * u), own if k == 1 else own[j * u:(j + 1) * u])
    if lane is None:
        return own  # one rank: one partial needs no sum (and no fp32 round trip)
    for transfer, _ in in_flight:
        lane.wait(transfer)
    lane.finish()
    acc = accum_dtype(dtype)
    total = arrived.sum(0, dtype=acc)
    return total if acc == dtype else total.to(dtype)

