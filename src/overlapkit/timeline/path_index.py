"""One rank's spans indexed for the critical-path walk (timeline/critical_path.py): by lane, by end,
its host threads' syncs and outermost ops, its compute threads' waits; and what let a lane go on.
"""

from __future__ import annotations

import bisect

from .framework import GRAPH_LAUNCHES

GAP_MS = 0.02
"""A gap shorter than this between a piece of work and its cause is latency, counted with the work."""
RELEASE_MS = 0.05
"""A GPU stream that resumes within this of another lane's end is taken to have waited for it (an event)."""
RELEASE_LATE_MS = 50.0
"""A CPU thread's wait may end up to this long before the traced end of the gloo transfer it waited for."""
LOOKBACK = 64
"""How many earlier-ending spans of a rank are searched for a cross-lane cause."""

class TraceIndex:
    """What the walk needs of one trace whatever the step, built once: its spans by step, host syncs,
    waits, outermost host ops and graph launches."""

    def __init__(self, trace) -> None:
        self.trace = trace
        self.by_step: dict = {}
        for i, s in enumerate(trace.spans):
            self.by_step.setdefault(s.step, []).append(i)
        self.syncs = _per_thread((tid, b, a) for tid, a, b in trace.host_syncs)
        self.blocked = _per_thread((f"thread {tid}", b, a) for tid, a, b in trace.blocked)
        self.ops = _per_thread(trace.host_ops)
        self.ops.update({f"thread {tid}": v for tid, v in list(self.ops.items())})
        self.op_starts = {tid: [o[0] for o in v] for tid, v in self.ops.items()}
        self.graph_launch = {i: iss[1] for i, iss in enumerate(trace.issue)
                             if iss is not None and iss[2] in GRAPH_LAUNCHES}


class RankIndex:
    """One rank's spans of one step indexed for the walk: by lane, by end, and its host threads."""

    def __init__(self, shared: TraceIndex, step, every_step: bool = False) -> None:
        trace = shared.trace
        self.t, self.rank = trace, trace.rank
        self.idx = list(range(len(trace.spans))) if every_step else shared.by_step.get(step, [])
        spans = trace.spans
        self.lane_of, self.pos, lanes = {}, {}, {}
        for i in self.idx:  # spans are sorted by (start, end): so is each lane
            lane = spans[i].stream
            ids = lanes.setdefault(lane, [])
            self.lane_of[i], self.pos[i] = lane, len(ids)
            ids.append(i)
        self.lanes = lanes
        self.lane_starts = {lane: [spans[i].start_ms for i in ids] for lane, ids in lanes.items()}
        self.by_end = sorted(self.idx, key=lambda i: spans[i].end_ms)
        self.ends = [spans[i].end_ms for i in self.by_end]
        self.syncs, self.blocked, self.ops = shared.syncs, shared.blocked, shared.ops
        self.op_starts, self.graph_launch = shared.op_starts, shared.graph_launch
        self.start = spans[self.idx[0]].start_ms if self.idx else 0.0

    def span(self, i):
        return self.t.spans[i]

    def lane_prev(self, i):
        p = self.pos[i]
        return self.lanes[self.lane_of[i]][p - 1] if p > 0 else None

    def issue(self, i):
        return self.t.issue[i] if i < len(self.t.issue) else None

    def ended_before(self, t: float, lo: float, skip_lane=None, comm_only: bool = False, started_by=None):
        """The span (index) of this rank ending latest in (lo, t], not on `skip_lane` (and, with
        `started_by`, starting before that time)."""
        k = bisect.bisect_right(self.ends, t + 1e-9) - 1
        for j in range(k, max(-1, k - LOOKBACK), -1):
            i = self.by_end[j]
            if self.ends[j] <= lo:
                return None
            s = self.t.spans[i]
            if self.lane_of[i] != skip_lane and (not comm_only or s.is_comm) and \
                    (started_by is None or s.start_ms < started_by):
                return i
        return None

    def lane_at(self, lane, t: float):
        """On `lane`: the last span starting before t (it holds t, or ended before it), or None."""
        k = bisect.bisect_left(self.lane_starts.get(lane, []), t) - 1
        return self.lanes[lane][k] if k >= 0 else None

    def released(self, lane, a: float, b: float):
        """What let `lane` go on at b after standing still since a: a wait that ended at b (CPU threads:
        the transfer it waited for), or work on another lane ending just before b; None: nothing did."""
        waits = self.blocked.get(lane)
        if waits is not None:
            k = bisect.bisect_right(waits, (b + GAP_MS, float("inf"))) - 1
            if k >= 0 and waits[k][0] >= b - GAP_MS and waits[k][0] > a:
                # gloo closes its range just after completing the work the thread waited on
                x = self.ended_before(waits[k][0] + RELEASE_LATE_MS, max(a, waits[k][1]), lane, comm_only=True,
                                      started_by=waits[k][0])
                if x is not None:
                    return x
        if lane.startswith("thread "):
            # A CPU thread that ran nothing traced while a transfer of its rank was in flight waited for it
            # in a call the profiler does not see (DDP's reducer waits for its buckets in C++).
            return self.ended_before(b, a, lane, comm_only=True, started_by=b)
        return self.ended_before(b, max(a, b - RELEASE_MS), lane)

    def host_op(self, tid, t: float):
        """(start, end, name) of the outermost op of thread tid starting before t, or None."""
        k = bisect.bisect_left(self.op_starts.get(tid, []), t) - 1
        return (k, self.ops[tid][k]) if k >= 0 else (None, None)

    def last_sync(self, tid, t: float, lo: float):
        v = self.syncs.get(tid)
        if not v:
            return None
        k = bisect.bisect_right(v, (t + 1e-9, float("inf"))) - 1
        return v[k][0] if k >= 0 and v[k][0] > lo else None


def _per_thread(rows) -> dict:
    out: dict = {}
    for row in rows:
        out.setdefault(row[0], []).append(tuple(row[1:]))
    for v in out.values():
        v.sort()
    return out
