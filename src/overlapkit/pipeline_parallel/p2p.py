"""The transfers of one pipeline rank, tick by tick: with overlap="bulk" the receive of what a
neighbour produces next is posted before this rank computes, and sends never wait, so a
transfer runs under the compute of another micro-batch; without it every tick's transfers are
waited for at once (the synchronous reference).

Every rank issues one batch per tick of the timetable: the sends its action of that tick
produced, and the receives of what its neighbours produce at the next tick (overlap) or at this
tick (synchronous). Both ends of every pair then issue their transfers in the same tick order,
which is what NCCL's in-order matching needs; gloo additionally matches each receive to its
send by tag, so a receive can never be filled by another transfer's bytes.
"""

from __future__ import annotations

import time

import torch

from ..runtime import comm
from ..runtime import recorder as _rec
from .schedules import Action
from .timetable import Timetable, Transfer


def producer_key(t: Transfer) -> tuple[str, int, int]:
    """(op, chunk, mb) of the action whose result `t` carries."""
    a = t.action
    return ("F", a.chunk - 1, a.mb) if a.op == "F" else ("B", a.chunk + 1, a.mb)


class TickComm:
    """Posts and waits the transfers of `rank` in timetable order over the pipeline group."""

    def __init__(self, table: Timetable, rank: int, group, overlap: bool,
                 shapes: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device,
                 sends: dict[int, list[Transfer]] | None = None, recvs: dict[int, list[Transfer]] | None = None) -> None:
        self.table, self.rank, self.group, self.overlap = table, rank, group, overlap
        self.shapes, self.device = shapes, device
        # The engine passes them in, computed once: they are the same every step.
        self._sends = table.sends(rank) if sends is None else sends
        self._recvs = table.recvs(rank) if recvs is None else recvs
        self._posted: set[int] = set()
        self._inbox: dict[Action, tuple[torch.Tensor, comm.Handle, Transfer]] = {}
        self._send_handles: list[comm.Handle] = []
        self._waited: set[int] = set()
        self._keep: list[torch.Tensor] = []
        self.send_times: dict[int, float] = {}
        """tag -> host time (perf_counter) this rank issued that send: where a neighbour's wait stops being bubble."""
        self.waits: list[tuple[float, float, int, int, comm.Handle]] = []
        """(wait start, wait end, peer, tag, handle) of every receive this rank waited for."""

    def _buffer(self, t: Transfer) -> torch.Tensor:
        a = t.action
        shape, dtype = self.shapes[a.chunk - 1] if a.op == "F" else self.shapes[a.chunk]
        return torch.empty(shape, dtype=dtype, device=self.device)

    def start(self) -> None:
        """Post the receives of tick 0 (overlap only): before the first compute."""
        if self.overlap:
            self._issue([], self._recvs.get(0, []))

    def post(self, tick: int, results: dict[tuple[str, int, int], torch.Tensor]) -> None:
        """Issue tick `tick`'s batch once: its sends (from `results`) and the receives it covers."""
        if tick in self._posted:
            return
        self._posted.add(tick)
        sends = self._sends.get(tick, [])
        recvs = self._recvs.get(tick + 1 if self.overlap else tick, [])
        send_h = self._issue([(results[producer_key(t)], t) for t in sends], recvs)
        if not self.overlap:
            send_h.wait()
            for t in recvs:
                self.get(t.action)

    def _issue(self, sends: list[tuple[torch.Tensor, Transfer]], recvs: list[Transfer]):
        out = []
        for data, t in sends:
            data = data.detach().contiguous()
            self._keep.append(data)  # alive until the send completes
            out.append((data, t.dst, t.tag))
        bufs = [(self._buffer(t), t.src, t.tag) for t in recvs]
        now = time.perf_counter()
        for _, t in sends:
            self.send_times[t.tag] = now
        send_h, recv_hs = comm.send_recv(out, bufs, self.group)
        self._send_handles.append(send_h)
        for (buf, _, _), t, h in zip(bufs, recvs, recv_hs):
            self._inbox[t.action] = (buf, h, t)
        return send_h

    def has(self, action: Action) -> bool:
        return action in self._inbox

    def get(self, action: Action) -> torch.Tensor:
        """The received input of `action`, waiting for it if it is still in flight."""
        buf, h, t = self._inbox[action]
        if id(h) not in self._waited:  # the waits list holds h, so its id is not reused
            t0 = time.perf_counter()
            h.wait()
            self._waited.add(id(h))
            self.waits.append((t0, time.perf_counter(), t.src, t.tag, h))
        return buf

    def take(self, action: Action) -> torch.Tensor:
        buf = self.get(action)
        del self._inbox[action]
        return buf

    def finish(self) -> None:
        """Wait for every send (the receives were all taken by the actions)."""
        for h in self._send_handles:
            h.wait()
        self._send_handles, self._keep = [], []
        if self._inbox:
            raise RuntimeError(f"pipeline rank {self.rank}: received inputs no action used: {list(self._inbox)}")


def restamp_receives(waits, peer_send_times: dict[int, dict[int, float]]) -> list[tuple[float, float]]:
    """Bubble intervals (host clock) of the waits; each receive's recorded span now starts at its send.

    A receive posted early covers its neighbour's compute until the neighbour sends: that part
    is the neighbour's work, not communication. From the send on it is the transfer. The part
    of a wait before the send is the bubble: this rank idle, waiting for its neighbour.
    """
    bubbles = []
    for t0, t1, peer, tag, h in waits:
        sent = peer_send_times.get(peer, {}).get(tag)
        if sent is None:
            continue
        if sent > t0:
            bubbles.append((t0, min(sent, t1)))
        pending = getattr(h, "pending", None)
        if pending is not None and isinstance(pending.start, float):
            pending.start = max(pending.start, min(sent, pending.end if pending.end is not None else sent))
    return bubbles


def record_bubbles(intervals: list[tuple[float, float]], step: int) -> None:
    """Put the bubble on the active recorder as `pp_bubble` spans (lane "bubble"; host clock).

    The recorder has hooks for compute and communication only; a bubble is neither, so its spans
    are added as finished entries the recorder resolves like any other at close.
    """
    rec = _rec.active()
    for start, end in intervals:
        rec.record_span("pp_bubble", "wait for neighbour", "bubble", start, end, step)


def recording() -> bool:
    """Whether a CPU-clock timeline recorder is active (the bubble split needs host clocks)."""
    rec = _rec.active()
    return rec is not None and not rec.cuda
