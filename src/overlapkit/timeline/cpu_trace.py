"""Read a CPU-only (gloo) trace: gloo's transfers against the computation of the threads beside them.

Communication is gloo's `gloo:<collective>` ranges, which run on gloo's worker threads from
the start to the end of a transfer (send/recv on the issuing thread). Computation is:

- in a trace of an overlapkit job, its `overlapkit.compute.<name>` ranges, and the CPU ops the same
  threads ran outside them (named `cpu ops`: a TP layer names only its GEMMs);
- in any other job's trace (plain DDP, HTA's gloo traces), the CPU ops (`cpu_op` events) of
  the threads that run no gloo transfer — the main and autograd threads, where the model runs.

Either way, time a thread spent blocked in communication is not computation even inside a
range that encloses it: an `overlapkit.wait` range (a `Handle.wait()`), a wait op, or a gloo
transfer run on that thread, or what torch FSDP2's hook ranges hold beyond their CPU ops
(`timeline/fsdp2.py`; not when overlapkit's fully_shard issued FSDP2's collectives, whose waits
are marked). A send/recv overlapkit issued is the exception: gloo's range for it sits
on the issuing thread from issue to completion while that thread computes on, and overlapkit
marks the wait itself. A trace that records (almost) no CPU ops beside its transfers has
no computation to compare with: its overlap is unknown, not 0 %.
"""

from __future__ import annotations

from ..runtime import intervals as iv
from .fsdp2 import blocked_in_hooks, fsdp2_comm
from .kinds import collective_kind, range_label
from .messages import input_bytes
from .ranges import Ranges
from ..runtime.spans import COMPUTE, Span

UNKNOWN_BELOW = 0.001
"""CPU ops (of a trace without overlapkit ranges) below this share of the communication time: no compute to judge by."""
_RECV_OF = {"pp_send": "pp_recv"}
"""One batch of pipeline sends and receives is issued under its sends' range (comm.send_recv); gloo
names each transfer's direction, so a receive in it takes the receive kind."""
_NOT_COMPUTE_PREFIXES = ("c10d::", "gloo:", "record_param_comms", "ProfilerStep", "nccl:")


def _is_compute_op(name: str) -> bool:
    return not name.startswith(_NOT_COMPUTE_PREFIXES) and "wait" not in name.lower()


def _group_size(info: dict) -> int:
    """The process groups' size when they all have one, else 0 (gloo ranges do not say which group ran them)."""
    sizes = {pg.get("pg_size") for pg in info.get("pg_config") or [] if isinstance(pg, dict)}
    if len(sizes) == 1 and isinstance(next(iter(sizes)), int):
        return next(iter(sizes))
    return 0


def _issued_by_overlapkit(ranges: Ranges, tid, ts: float) -> bool:
    """Whether a gloo range starting at `ts` on `tid` lies inside an overlapkit issue range there."""
    owner = ranges.find(tid, ts)
    return owner is not None and range_label(owner["name"])[0] == "comm"


OPS_OUTSIDE = "cpu ops"
"""The name of the computation a compute thread ran outside overlapkit's compute ranges."""


def _ops_outside(compute_ranges, ops, blocked) -> list:
    """(thread, start, end, OPS_OUTSIDE) of the CPU ops that threads running overlapkit's compute ranges ran
    outside them and outside their waits: a TP layer names only its GEMMs, and the attention, norms, loss and
    optimizer step between them computed all the same (they are not host idle time)."""
    ranged: dict[object, list] = {}
    for tid, s, e, _ in compute_ranges:
        ranged.setdefault(tid, []).append((s, e))
    by_tid: dict[object, list] = {}
    for tid, start, end, name in ops:
        if tid in ranged and _is_compute_op(name):
            by_tid.setdefault(tid, []).append((start, end))
    return [(tid, a, b, OPS_OUTSIDE) for tid, pairs in by_tid.items()
            for a, b in iv.subtract(iv.subtract(iv.union(pairs), iv.union(ranged[tid])), blocked.get(tid, []))]


def cpu_spans(ranges: Ranges, gloo, ops, markers: Ranges, info: dict, fsdp: Ranges | None = None):
    """([(issue time, span in raw µs, True, (thread, issue time) or None)], compute known, notes, blocked) of a
    CPU trace (`fsdp`: FSDP2's ranges); blocked: (thread, start, end) of the compute threads' waits."""
    # gloo opens a send/recv's range on the issuing thread and closes it when the transfer completes,
    # while that thread goes on computing: such a range, issued inside an overlapkit issue range, is
    # not time the thread sat blocked (overlapkit marks its waits with `overlapkit.wait`).
    worker = [g for g in gloo if not _issued_by_overlapkit(ranges, g[0], g[1])]
    comm_tids = {g[0] for g in worker}
    blocked: dict[object, list] = {}
    for tid, start, end, _, _ in worker:
        blocked.setdefault(tid, []).append((start, end))
    issued, compute_ranges = [], []
    for tid, start, end, value in ranges.all():
        what, lab = range_label(value["name"])
        if what == "wait":
            blocked.setdefault(tid, []).append((start, end))
        elif what == "compute":
            compute_ranges.append((tid, start, end, lab))
        else:
            value.update(kind=lab, claimed=False, tid=tid)
            issued.append(value)
    for tid, start, end, name in ops:
        if "wait" in name.lower():
            blocked.setdefault(tid, []).append((start, end))
    # FSDP2's own hooks wait for its collectives unmarked; overlapkit's fully_shard issues them
    # through `comm`, whose waits carry `overlapkit.wait`: then the marks say what blocked.
    if fsdp is not None and not any(v["kind"].startswith("zero_") for v in issued):
        hooks = blocked_in_hooks([(t, a, b) for t, a, b, _ in fsdp.all()],
                                 [(t, a, b) for t, a, b, name in ops if _is_compute_op(name)])
        for tid, pairs in hooks.items():
            blocked.setdefault(tid, []).extend(pairs)
    blocked = {tid: iv.union(pairs) for tid, pairs in blocked.items()}

    out, notes = [], []
    if compute_ranges:
        pieces = [(tid, a, b, lab) for tid, s, e, lab in compute_ranges
                  for a, b in iv.subtract([(s, e)], blocked.get(tid, []))]
        pieces += _ops_outside(compute_ranges, ops, blocked)
    else:
        by_tid: dict[object, list] = {}
        for tid, start, end, name in ops:
            if tid not in comm_tids and _is_compute_op(name):
                by_tid.setdefault(tid, []).append((start, end))
        pieces = [(tid, a, b, "cpu ops") for tid, pairs in by_tid.items()
                  for a, b in iv.subtract(iv.union(pairs), blocked.get(tid, []))]
        # Without overlapkit's ranges, the issue points are the c10d ops (one per collective).
        issued = [{"ts": s, "tid": tid, "kind": None, "claimed": False, "op": name}
                  for tid, s, _, name in ops if name.startswith("c10d::") and tid not in comm_tids
                  and "wait" not in name.lower() and "barrier" not in name.lower()]
    if fsdp is not None:
        for v in issued:
            if chain := fsdp.enclosing(v["tid"], v["ts"]):
                what = v["kind"].removeprefix("zero_") if v["kind"] else collective_kind(v.get("op", ""))
                if (got := fsdp2_comm([r["name"] for r in chain], what)) is not None:
                    v["kind"], v["label"] = got
    for tid, a, b, lab in pieces:
        marked = markers.find(tid, a)
        out.append((a, Span(kind=COMPUTE, name=lab, stream=f"thread {tid}", start_ms=a, end_ms=b,
                            phase=marked["phase"] if marked else None), True, None))

    comm_us = iv.length(iv.union((g[1], g[2]) for g in gloo))
    compute_us = iv.length(iv.union((a, b) for _, a, b, _ in pieces))
    compute_known = bool(compute_ranges) or not (comm_us > 0 and compute_us < UNKNOWN_BELOW * comm_us)
    if not compute_known:
        notes.append(f"the trace records {compute_us / 1e3:.3f} ms of CPU ops beside {comm_us / 1e3:.1f} ms of "
                     f"gloo transfers: no computation to judge overlap by (profile with CPU ops recorded)")
        out = []
    out += _gloo_spans(ranges, gloo, issued, markers, comm_tids, _group_size(info))
    waits = [(tid, a, b) for tid, pairs in blocked.items() if tid not in comm_tids for a, b in pairs]
    return out, compute_known, notes, waits


def _gloo_spans(ranges, gloo, issued, markers, comm_tids, group_size):
    """A span per gloo range, with the kind and issue point of the range that issued it."""
    issued.sort(key=lambda v: v["ts"])
    out, first_free = [], 0
    for tid, start, end, name, args in sorted(gloo, key=lambda g: g[1]):
        owner = ranges.find(tid, start)  # send/recv run inside their own issue range
        if owner is None or "kind" not in owner:
            # A worker-thread transfer belongs to the earliest unclaimed issue before it:
            # gloo runs one process group's works in issue order.
            while first_free < len(issued) and issued[first_free]["claimed"]:
                first_free += 1
            ok = first_free < len(issued) and issued[first_free]["ts"] <= start
            owner = issued[first_free] if ok else None
        if owner is not None:
            owner["claimed"] = True
        kind = owner["kind"] if owner is not None and owner["kind"] else collective_kind(name)
        if name == "gloo:recv":
            kind = _RECV_OF.get(kind, kind)
        at = owner["ts"] if owner is not None else start
        marked = markers.find(owner["tid"], at) if owner is not None and "tid" in owner else None
        if marked is None:
            marked = markers.find_any(at, skip=comm_tids)
        name = owner.get("label", name) if owner is not None else name
        issuer = (owner["tid"], owner["ts"]) if owner is not None and "tid" in owner else None
        out.append((at, Span(kind=kind, name=name, stream=f"thread {tid}", start_ms=start, end_ms=end,
                             nbytes=input_bytes(args), group_size=group_size,
                             phase=marked["phase"] if marked else None), True, issuer))
    return out
