"""Async collectives that return a `Handle`, stamped on the timeline; the CUDA_DEVICE_MAX_CONNECTIONS check.

Every engine talks through these functions, so that (1) what overlaps with what is visible
in one place — a collective is issued, compute runs, `Handle.wait()` joins — and (2) the
timeline recorder sees every transfer with its kind, size and group without each engine
having to remember to stamp it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from . import recorder as _rec, state

# The torch collectives behind all_gather / reduce_scatter, unrecorded: for an engine's own `launch`
# thunk. torch >= 2.13 renames the tensor forms; 2.11 has only the old names.
dist_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
dist_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


_sizes: dict = state.cache_dict("comm.size_rank")
"""group -> (size, rank): fixed for a group's life, and `dist.get_world_size` costs ~1 µs of
checks a call, paid several times per TP linear (the cache holds the group, so its id is never reused)."""


def _size_rank(group: dist.ProcessGroup) -> tuple[int, int]:
    sr = _sizes.get(group)
    if sr is None:
        sr = _sizes[group] = (dist.get_world_size(group), dist.get_rank(group))
    return sr


def group_size(group: dist.ProcessGroup | None) -> int:
    if group is None:
        return 1
    # Under torch.compile dist.get_world_size is what dynamo folds to a constant (not a dict keyed by group).
    return dist.get_world_size(group) if torch.compiler.is_compiling() else _size_rank(group)[0]


def group_rank(group: dist.ProcessGroup | None) -> int:
    if group is None:
        return 0
    return dist.get_rank(group) if torch.compiler.is_compiling() else _size_rank(group)[1]


_before_wait = threading.local()


@contextlib.contextmanager
def before_waits(fn: Callable[[], None]):
    """While active in this thread, `fn()` runs before every `Handle.wait()` of a handle not yet waited for.

    A cooperative scheduler hands the thread over there (a pipeline's overlapped forward and backward
    switch at every wait): the call depends only on the program's order, never on whether the
    transfer happens to be done, so every rank switches at the same points and issues its
    collectives in the same order.
    """
    before = getattr(_before_wait, "fn", None)
    _before_wait.fn = fn
    try:
        yield
    finally:
        _before_wait.fn = before


class Handle:
    """One or more works in flight. `wait()` joins them: the caller's stream on CUDA, the thread on CPU.

    A wait that fails (a peer timed out, died or broke step) raises, when a peer of the group left a
    reason on the store (`agreement.report_problem`, or a configuration check it is in and this rank
    is not), a RankMismatchError that names that rank and its reason instead of the transport's words.
    """

    __slots__ = ("_works", "_pending", "_rec", "_done", "_group", "_label")

    def __init__(self, works: Sequence[dist.Work], pending=None, rec=None, group=None, label: str = "") -> None:
        self._works = [w for w in works if w is not None]
        self._pending, self._rec = pending, rec
        self._done = False
        self._group, self._label = group, label

    @property
    def pending(self):
        """The recorder's `PendingSpan` of this transfer, or None when nothing records it."""
        return self._pending

    def wait(self) -> None:
        if self._done:
            return
        hook = getattr(_before_wait, "fn", None)
        if hook is not None:
            hook()
        rec = self._rec
        # The stretch the caller spends waiting (the host on CPU, the current stream on
        # CUDA) is not compute, even inside a compute span that encloses it. Its stamps sit
        # inside the profiler range that marks the same stretch for a trace's reader, as a
        # compute span's stamps sit outside its range: the record of a computation then holds
        # the traced one, never less.
        with _rec.wait_range():
            t0 = rec.now() if rec is not None else None
            try:
                for w in self._works:
                    w.wait()
            except Exception as e:  # noqa: BLE001 - a peer that broke step may have said why
                from .agreement import raise_explained
                raise_explained(self._group, _ENGINES.get(self._label.split("_", 1)[0], "overlapkit"), e,
                                f"the {self._label}")
            if rec is not None:
                if not rec.cuda:
                    rec.comm_done(self._pending)
                rec.blocked(t0, rec.now())
        self._done = True

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)


_ENGINES = {"tp": "tensor parallel", "dp": "data parallel", "zero": "ZeRO", "ep": "expert parallel",
            "cp": "context parallel", "pp": "pipeline"}


def launch(kind: str, name: str, nbytes: int, group, issue, watch: bool = True) -> Handle:
    """Issue a collective (the `issue` thunk returns its works) and stamp it if recording.

    `watch=False`: works that tell their completion only when waited (gloo's send/recv, whose
    is_completed() stays False until then) are not polled on CPU — the wait stamps their end;
    polling them would only take cores and the GIL from the ranks being measured.
    """
    rec = _rec.active()
    label = f"{kind} {name}".strip()
    if rec is None:
        with _rec.comm_range(kind, name):  # names the transfer in a profiler trace, if one runs
            return Handle(issue(), group=group, label=label)
    pending = rec.comm_issued(kind, name, nbytes, group_size(group))
    with _rec.comm_range(kind, name):
        works = [w for w in issue() if w is not None]
    if watch or rec.cuda:
        _stamp_done(rec, pending, works)
    return Handle(works, pending, rec, group=group, label=label)


def _stamp_done(rec, pending, works) -> None:
    """Have the recorder stamp when `works` finish, without making the caller wait for them."""
    if rec.cuda:
        # Stamp completion on a side stream that waits for the works, so the stamp costs the
        # compute stream nothing and marks the real end of the transfer, not the wait.
        side = _stamp_stream(rec.device)
        side.wait_stream(torch.cuda.current_stream(rec.device))
        with torch.cuda.stream(side):
            for w in works:
                w.wait()
            rec.comm_done(pending, rec.now())
    else:
        for w in works:
            rec.comm_watch(pending, w)


_stamp_streams: dict[torch.device, torch.cuda.Stream] = state.cache_dict("comm.stamp_streams")


def _stamp_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _stamp_streams:
        _stamp_streams[device] = torch.cuda.Stream(device)
    return _stamp_streams[device]


def _finish(h: Handle, async_op: bool) -> Handle:
    if not async_op:
        h.wait()
    return h


def all_gather(out: torch.Tensor, inp: torch.Tensor, group, *, kind: str = "tp_all_gather",
               name: str = "", async_op: bool = True) -> Handle:
    """Gather `inp` from every rank into `out` along dim 0 (rank order)."""
    nbytes = out.numel() * out.element_size()
    h = launch(kind, name, nbytes, group, lambda: [dist_all_gather_tensor(out, inp, group=group, async_op=True)])
    return _finish(h, async_op)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group, *, kind: str = "tp_reduce_scatter",
                   name: str = "", async_op: bool = True, op=dist.ReduceOp.SUM) -> Handle:
    """Sum `inp` over ranks and keep this rank's slice of dim 0 in `out`."""
    nbytes = inp.numel() * inp.element_size()
    h = launch(kind, name, nbytes, group,
               lambda: [dist_reduce_scatter_tensor(out, inp, op=op, group=group, async_op=True)])
    return _finish(h, async_op)


def all_reduce(t: torch.Tensor, group, *, kind: str = "tp_all_reduce", name: str = "",
               async_op: bool = True, op=dist.ReduceOp.SUM) -> Handle:
    """Reduce `t` in place over the group."""
    nbytes = t.numel() * t.element_size()
    h = launch(kind, name, nbytes, group, lambda: [dist.all_reduce(t, op=op, group=group, async_op=True)])
    return _finish(h, async_op)


def all_reduce_coalesced(tensors: Sequence[torch.Tensor], group, *, kind: str, name: str = "") -> None:
    """Sum `tensors` (one dtype) over the group in place, as one flat synchronous all-reduce."""
    if not tensors:
        return
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    all_reduce(flat, group, kind=kind, name=name, async_op=False)
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def _p2p(sends, recvs, group):
    """A thunk that issues the sends, then the receives, and returns their works (one per op on gloo, where
    nothing coalesces; NCCL batches them into one)."""
    if group is not None and _is_gloo(group):
        # gloo does not coalesce: batch_isend_irecv would issue these one by one, in this order, with
        # tag 0; issuing them on the group (peers are group ranks) skips ~30 µs of P2POp checks.
        def issue():
            return [group.send([t], p, 0) for t, p in sends] + [group.recv([t], p, 0) for t, p in recvs]
        return issue
    ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(group, p), group) for t, p in sends]
    ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, p), group) for t, p in recvs]
    return lambda: dist.batch_isend_irecv(ops)


def exchange(sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]],
             group, *, kind: str = "tp_all_gather", name: str = "", async_op: bool = True) -> Handle:
    """Batched point-to-point: send each (tensor, group_peer) and receive each (tensor, group_peer)."""
    if not sends and not recvs:
        return Handle([])
    nbytes = sum(t.numel() * t.element_size() for t, _ in sends)
    return _finish(launch(kind, name, nbytes, group, _p2p(sends, recvs, group), watch=not _is_gloo(group)),
                   async_op)


def ring_exchange(sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]],
                  group, *, kind: str, name: str = "") -> tuple[Handle, Handle]:
    """`exchange`, as (the receives' handle, the sends' handle) to join apart.

    A ring waits for what it receives before computing on it, and for what it sent only before that
    buffer changes or is freed. Joining both at once ties each rank to its successor as well as its
    predecessor: a gloo send completes only after the peer has posted its receive, so a late
    successor would stall this rank too. The timeline's span is the receives' (under NCCL's one
    coalesced work, both handles join the same work).
    """
    if not sends and not recvs:
        return Handle([]), Handle([])
    nbytes = sum(t.numel() * t.element_size() for t, _ in sends)
    issue = _p2p(sends, recvs, group)
    # The span is the receives': with none (a rank only sending, e.g. a block its peer alone attends), none.
    rec = _rec.active() if recvs else None
    pending = rec.comm_issued(kind, name, nbytes, group_size(group)) if rec is not None else None
    with _rec.comm_range(kind, name):
        works = [w for w in issue() if w is not None]
    if len(works) == len(sends) + len(recvs):
        sent, received = works[:len(sends)], works[len(sends):]
    else:
        sent = received = works
    if rec is not None and rec.cuda:
        _stamp_done(rec, pending, received)
    # On CPU a p2p work tells its completion only when waited: the receives' wait stamps the end.
    label = f"{kind} {name}".strip()
    return Handle(received, pending, rec, group=group, label=label), Handle(sent, group=group, label=label)


_gloo: dict = state.cache_dict("comm.is_gloo")


def _is_gloo(group) -> bool:
    if group not in _gloo:
        _gloo[group] = str(dist.get_backend(group)) == "gloo"
    return _gloo[group]


def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, group, *, out_splits: Sequence[int] | None = None,
                      in_splits: Sequence[int] | None = None, kind: str = "ep_all_to_all", name: str = "",
                      async_op: bool = True) -> Handle:
    """Send rows `in_splits[r]` of `inp` (dim 0, in rank order) to rank r; receive `out_splits[r]` rows from r into `out`.

    Splits None means equal splits. The split sizes must already agree across ranks (what rank
    r sends to this rank is what this rank expects from r): exchange them first, e.g. with an
    equal-split all-to-all of the counts.
    """
    nbytes = inp.numel() * inp.element_size()
    outs = list(out_splits) if out_splits is not None else None
    ins = list(in_splits) if in_splits is not None else None
    h = launch(kind, name, nbytes, group,
               lambda: [dist.all_to_all_single(out, inp, outs, ins, group=group, async_op=True)])
    return _finish(h, async_op)



def send_recv(sends: Sequence[tuple[torch.Tensor, int, int]], recvs: Sequence[tuple[torch.Tensor, int, int]],
              group, *, send_kind: str = "pp_send", recv_kind: str = "pp_recv",
              name: str = "") -> tuple[Handle, list[Handle]]:
    """Point-to-point as one batch on the wire: (one handle for the sends, one handle per receive).

    Each entry is (tensor, group_peer, tag). One `batch_isend_irecv` (one NCCL group) holds all
    of them, so two neighbours that both send and receive never wait on each other's order;
    gloo matches by tag, NCCL (which ignores tags) by issue order. Each receive is its own span
    and handle, so waiting for one does not wait for the others; under NCCL's coalescing the
    batch is one work, and every handle then waits for all of it.
    """
    ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(group, p), group, tag) for t, p, tag in sends]
    ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, p), group, tag) for t, p, tag in recvs]
    if not ops:
        return Handle([]), []
    rec = _rec.active()
    parts = [(send_kind, list(sends))] if sends else []
    parts += [(recv_kind, [r]) for r in recvs]
    pend = [rec.comm_issued(k, name, sum(t.numel() * t.element_size() for t, _, _ in items), 2)
            if rec is not None else None for k, items in parts]
    with _rec.comm_range(send_kind if sends else recv_kind, name):
        works = [w for w in dist.batch_isend_irecv(ops) if w is not None]
    if len(works) == len(ops):
        split = ([works[:len(sends)]] if sends else []) + [[w] for w in works[len(sends):]]
    else:
        split = [works] * len(parts)
    handles = []
    for p, (k, _), ws in zip(pend, parts, split):
        # On CPU a p2p work tells its completion only when waited (the wait stamps the end), and a
        # watcher polling gloo's send works while a profiler runs left a send that never completed.
        if p is not None and rec.cuda:
            _stamp_done(rec, p, ws)
        handles.append(Handle(ws, p, rec if p is not None else None, group=group, label=f"{k} {name}".strip()))
    if not sends:
        handles.insert(0, Handle([]))
    return handles[0], handles[1:]


# -- CUDA_DEVICE_MAX_CONNECTIONS ----------------------------------------------------------

MAX_CONNECTIONS_ADVICE = (
    "CUDA_DEVICE_MAX_CONNECTIONS={value}: {meaning}. Tensor-parallel overlap on GPUs before "
    "Blackwell wants 1, so that a collective issued before a GEMM starts before it (one hardware "
    "queue keeps issue order); FSDP and multi-stream data-parallel overlap want it unset or > 1."
)


def max_connections_meaning(value: str | None) -> str:
    if value is None:
        return "unset (the driver's default, 8 hardware queues): kernels of different streams may start out of issue order"
    if value.strip() == "1":
        return "one hardware queue: kernels start in the order they were issued, across streams"
    return f"{value} hardware queues: kernels of different streams may start out of issue order"


_WARNED = state.capability_set("comm.warned")
"""The advice this process has printed once already (its name)."""


def warn_if_max_connections_unsuited(device: torch.device | str) -> bool:
    """Warn once when bulk TP overlap runs on CUDA without CUDA_DEVICE_MAX_CONNECTIONS=1. Returns True if it warned."""
    if torch.device(device).type != "cuda" or "max_connections" in _WARNED:
        return False
    value = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if value is not None and value.strip() == "1":
        return False
    _WARNED.add("max_connections")
    warnings.warn(MAX_CONNECTIONS_ADVICE.format(value=value, meaning=max_connections_meaning(value)),
                  RuntimeWarning, stacklevel=3)
    return True
