"""The cross-rank critical path of a step: the chain of work that set its length, and why each piece.

Walked backward from the step's last end, all ranks on one clock: each piece of work started when
the latest of its causes let it (its lane's previous work, its launch or issue, another lane's
work it waited on, a collective's last member to be ready). The segments tile the step, each
{rank, op, ms, why}; docs/timeline.md has the rules and the table of `why`.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from ..runtime import intervals as iv
from .collectives import Instance
from .messages import size_text
from .path_index import GAP_MS, LOOKBACK, RankIndex, TraceIndex

WHYS = ("compute", "exposed comm", "waiting for rank", "host launch gap", "copy", "idle")


@dataclass(slots=True)
class Segment:
    """One piece of the path."""

    rank: int
    op: str
    start_ms: float
    end_ms: float
    why: str
    kind: str = ""
    """The span's kind (compute, a collective, memcpy, host, idle)."""

    @property
    def ms(self) -> float:
        return self.end_ms - self.start_ms

    def to_dict(self) -> dict:
        return {"rank": self.rank, "op": self.op, "ms": self.ms, "why": self.why, "start_ms": self.start_ms,
                "end_ms": self.end_ms, "kind": self.kind}


@dataclass
class Path:
    """The critical path of one step (or of the whole window when the traces mark no steps)."""

    step: int | None
    start_ms: float
    end_ms: float
    segments: list
    crossings: list = field(default_factory=list)
    """Crossing rows: the collectives at which the path moved to the member the others waited for."""
    busy_ms: float = 0.0
    """The most time any one rank's lanes were busy in the step (the step cannot be shorter)."""

    @property
    def path_ms(self) -> float:
        return sum(s.ms for s in self.segments)

    @property
    def window_ms(self) -> float:
        return self.end_ms - self.start_ms

    def ms_by(self, why: str) -> float:
        return sum(s.ms for s in self.segments if s.why.startswith(why))

    def to_dict(self) -> dict:
        return {"step": self.step, "window_ms": self.window_ms, "path_ms": self.path_ms,
                "segments": [s.to_dict() for s in self.segments]}


def _op(s, R=None, index=None) -> str:
    if R is not None and s.is_compute and (i := R.graph_launch.get(index)) is not None:
        return f"CUDA graph launched at {i:.3f} ms"  # its kernels share the launch: one stretch of the path
    if R is not None and s.name == "cpu ops":  # a CPU trace's op time: name it by the outermost op
        _, op = R.host_op(s.stream, s.start_ms + 1e-9)
        if op is not None and op[1] >= s.start_ms:
            return op[2][:80]
    if s.is_comm:
        return f"{s.kind} {size_text(s.nbytes)}" + (f" {s.group}" if s.group else "")
    return s.name[:80] or s.kind


def _why(s) -> str:
    if s.is_compute:
        return "compute"
    return "exposed comm" if s.is_comm else "copy"


@dataclass
class Crossing:
    """Where the path crossed to the member a collective waited for."""

    op: str
    rank: int
    """The member that was ready last."""
    ready_ms: float
    """When it was ready."""
    others_ms: float
    """When the last of the other members had issued it (their own progress, not their waits)."""
    median_ms: float
    """When it would have been ready at the median pace of the others (from its step's start)."""


class _Walk:
    def __init__(self, ranks: dict, found: list[Instance], start: float) -> None:
        self.ranks, self.start = ranks, start
        self.inst = {}
        for inst in found:
            if all(r in ranks and i in ranks[r].pos for r, i in inst.members.items()):
                for r, i in inst.members.items():
                    self.inst[(r, i)] = inst
        self.out: list[Segment] = []
        self.crossings: list[Crossing] = []
        self.crossed: set[int] = set()
        self.mark: tuple[int, float] | None = None  # (rank k, others ready): the path waits for k above it

    def emit(self, rank, op, a, b, why, kind=""):
        a = max(a, self.start)
        if self.out:  # the walk goes back in time: nothing after what the path already holds (a member that
            b = min(b, self.out[-1].start_ms)  # a rank's clock shows starting after the collective ended there)
        if b <= a:
            return
        if self.mark is not None and self.mark[0] == rank and b > self.mark[1] and why != "exposed comm":
            cut = max(a, self.mark[1])
            self._add(Segment(rank, op, cut, b, f"waiting for rank {rank}", kind))
            b = cut
            if b <= a:
                return
        self._add(Segment(rank, op, a, b, why, kind))

    def _add(self, seg: Segment) -> None:
        last = self.out[-1] if self.out else None
        if last is not None and (last.rank, last.op, last.why) == (seg.rank, seg.op, seg.why) and \
                abs(last.start_ms - seg.end_ms) < 1e-9:
            last.start_ms = seg.start_ms
        else:
            self.out.append(seg)

    def ready(self, R: RankIndex, i: int) -> tuple[float, str, object]:
        """(when span i could start, what held it: 'lane'/'issue'/'none', the cause)."""
        s, prev, iss = R.span(i), R.lane_prev(i), R.issue(i)
        e_p = R.span(prev).end_ms if prev is not None else None
        L = min(iss[1], s.start_ms) if iss is not None else None
        if L is not None and (e_p is None or L > e_p):
            return L, "issue", iss
        if e_p is not None:
            return min(e_p, s.start_ms), "lane", prev
        return s.start_ms, "none", None

    def own_ready(self, R: RankIndex, i: int) -> float:
        """When a member's own work let it join collective span i: its start, or, when its lane was still
        busy with an earlier transfer (itself waiting, maybe for the late rank), its issue or the end of
        its last computation before it, whichever is later."""
        s, prev = R.span(i), R.lane_prev(i)
        if prev is None or not R.span(prev).is_comm or R.span(prev).end_ms < s.start_ms - GAP_MS:
            return s.start_ms
        iss = R.issue(i)
        own = iss[1] if iss is not None else R.start
        k = bisect.bisect_right(R.ends, s.start_ms + 1e-9) - 1
        for j in range(k, max(-1, k - LOOKBACK), -1):
            if R.t.spans[R.by_end[j]].is_compute:
                own = max(own, R.ends[j])
                break
        return min(own, s.start_ms)

    def run(self, r: int, i: int, limit: int) -> None:
        state = ("span", r, i, self.ranks[r].span(i).end_ms)
        seen = set()
        for _ in range(limit):
            if state is None or (state[0] != "cause" and state[-1] <= self.start + 1e-9):
                return
            if state in seen or (self.out and state[0] != "cause" and state[-1] > self.out[-1].start_ms + 1e-9):
                return  # the walk would go round or forward in time: stop; the rest of the window is untraced
            seen.add(state)
            kind, args = state[0], state[1:]
            state = self.host(*args) if kind == "host" else self.cause(*args) if kind == "cause" else self.step(*args)

    def step(self, r, i, t):
        """The path is in span i of rank r at t: its part up to t, then what let it start."""
        R = self.ranks[r]
        s = R.span(i)
        if self.mark is not None and self.mark[0] != r:
            self.mark = None
        inst = self.inst.get((r, i))
        if inst is not None:
            return self.collective(r, i, t, inst)
        at, how, cause = self.ready(R, i)
        if s.start_ms - at <= GAP_MS:  # the usual case: straight on from its cause, latency with the work
            self.emit(r, _op(s, R, i), at, t, _why(s), s.kind)
            return self.follow(r, i, at, how, cause)
        self.emit(r, _op(s, R, i), s.start_ms, t, _why(s), s.kind)
        return self.cause(r, i)

    def cause(self, r, i):
        """What let span i of rank r start: the path's next state (the gap before it is emitted)."""
        R = self.ranks[r]
        s = R.span(i)
        at, how, cause = self.ready(R, i)
        if s.start_ms - at > GAP_MS:
            if (x := R.released(R.lane_of[i], at, s.start_ms)) is not None:
                x_end = min(R.span(x).end_ms, s.start_ms)
                self.emit(r, _op(s, R, i), x_end, s.start_ms, _why(s), s.kind)  # the wake-up after the release
                return ("span", r, x, x_end)
            self.emit(r, "nothing traced", at, s.start_ms, "idle", "idle")
        else:
            self.emit(r, _op(s, R, i), at, s.start_ms, _why(s), s.kind)  # launch latency, with the work
        return self.follow(r, i, at, how, cause)

    def collective(self, r, i, t, inst):
        """A collective ends for all once its last member started it: the transfer after that is on the
        path, and before it the path follows that member."""
        s = self.ranks[r].span(i)
        starts = {m: self.ranks[m].span(j).start_ms for m, j in inst.members.items()}
        last = max(starts, key=lambda m: (starts[m], m == r))
        at = min(starts[last], t)
        self.emit(r, _op(s), at, t, "exposed comm", s.kind)
        crossing = self.crossing(inst, last, at)
        if crossing is not None:
            self.crossings.append(crossing)
            self.mark = (last, crossing.others_ms)
        return ("cause", last, inst.members[last])

    def crossing(self, inst, last, at):
        """The Crossing of collective `inst` whose last member `last` started it at `at`, or None when the
        others' own work was not ready before it (nobody waited for `last`)."""
        own = {m: self.own_ready(self.ranks[m], j) for m, j in inst.members.items() if m != last}
        others = max(own.values()) if own else at
        if not own or others >= at - GAP_MS:
            return None
        self.crossed.add(id(inst))
        anchor = {m: self._anchor(m) for m in inst.members}
        paces = sorted(own[m] - anchor[m] for m in own)
        half = len(paces) // 2
        median = paces[half] if len(paces) % 2 else (paces[half - 1] + paces[half]) / 2
        return Crossing(op=_op(self.ranks[last].span(inst.members[last])), rank=last, ready_ms=at,
                        others_ms=others, median_ms=anchor[last] + median)

    def late_on_path(self, segments: list) -> None:
        """Collectives the path did not cross at because it was already on their last member (that rank's
        own chain ended the step): the others waited for it all the same. Record them, and mark the path's
        stretch on that rank after the others were ready as waiting for it."""
        starts = [seg.start_ms for seg in segments]
        seen = set()
        for inst in self.inst.values():
            if id(inst) in seen or id(inst) in self.crossed:
                continue
            seen.add(id(inst))
            at = {m: self.ranks[m].span(j).start_ms for m, j in inst.members.items()}
            last = max(at, key=at.get)
            k = bisect.bisect_right(starts, at[last] - 1e-9) - 1
            if k < 0 or segments[k].rank != last or segments[k].end_ms < at[last] - 1e-9:
                continue
            c = self.crossing(inst, last, at[last])
            if c is not None:
                self.crossings.append(c)
                _relabel(segments, last, c.others_ms, c.ready_ms, f"waiting for rank {last}")

    def _anchor(self, rank) -> float:
        """The start of a rank's step: its ProfilerStep range when known, else its first span."""
        R = self.ranks[rank]
        step = R.span(R.idx[0]).step
        rng = R.t.step_ranges.get(step) if step is not None else None
        return rng[0] if rng is not None else R.start

    def follow(self, r, i, at, how, cause):
        R = self.ranks[r]
        if how == "lane":
            return ("span", r, cause, min(at, R.span(cause).end_ms))
        if how == "issue":
            lane = f"thread {cause[0]}"
            if lane in R.lanes:  # a CPU trace: the issuing thread's own spans
                j = R.lane_at(lane, at)
                if j is None:
                    return None
                e = R.span(j).end_ms
                if e >= at - GAP_MS:
                    self.emit(r, _op(R.span(j), R, j), min(at, e), at, _why(R.span(j)), R.span(j).kind)
                    return ("span", r, j, min(at, e))
                if (x := R.released(lane, e, at)) is not None:
                    x_end = min(R.span(x).end_ms, at)
                    self.emit(r, "nothing traced", x_end, at, "idle", "idle")
                    return ("span", r, x, x_end)
                self.emit(r, "nothing traced", e, at, "idle", "idle")
                return ("span", r, j, e)
            return ("host", r, cause[0], at)
        x = R.ended_before(R.span(i).start_ms, self.start)  # nothing before it on its lane, no issue
        if x is None:
            return None
        x_end = R.span(x).end_ms
        self.emit(r, "nothing traced", x_end, R.span(i).start_ms, "idle", "idle")
        return ("span", r, x, x_end)

    def host(self, r, tid, t):
        """A GPU rank's host thread ran from its last wait for the GPU to t: the path's host stretch."""
        R = self.ranks[r]
        e_s = R.last_sync(tid, t, self.start)
        lo = e_s if e_s is not None else self.start
        cur = t
        k, op = R.host_op(tid, cur)
        while cur > lo + 1e-9 and op is not None and op[1] > lo:
            a, b, name = op
            if b < cur:
                self.emit(r, "host (between ops)", max(b, lo), cur, "host launch gap", "host")
                cur = max(b, lo)
            if cur > lo:
                self.emit(r, name[:80], max(a, lo), cur, "host launch gap", "host")
                cur = max(a, lo)
            k -= 1
            op = R.ops[tid][k] if k >= 0 else None
        if cur > lo:
            self.emit(r, "host", lo, cur, "host launch gap", "host")
        if e_s is None:
            return None
        x = R.ended_before(e_s + GAP_MS, self.start)
        if x is None:
            return None
        x_end = min(e_s, R.span(x).end_ms)
        self.emit(r, "host sync", x_end, e_s, "host launch gap", "host")  # the sync's return after the GPU work
        return ("span", r, x, x_end)


def critical_path(traces, found: list[Instance], step: int | None = None, shared: dict | None = None) -> Path | None:
    """The critical path of `step` (None: every span, for traces without steps) over all ranks.
    `shared`: rank -> TraceIndex, when the caller walks several steps of the same traces."""
    shared = shared or {t.rank: TraceIndex(t) for t in traces}
    ranks = {t.rank: RankIndex(shared[t.rank], step, every_step=step is None) for t in traces}
    ranks = {r: R for r, R in ranks.items() if R.idx}
    if not ranks:
        return None
    start = min(R.start for R in ranks.values())
    last_r = max(ranks, key=lambda r: ranks[r].ends[-1])
    last_i, end = ranks[last_r].by_end[-1], ranks[last_r].ends[-1]
    w = _Walk(ranks, found, start)
    w.run(last_r, last_i, limit=4 * sum(len(R.idx) for R in ranks.values()) + 1000)
    covered = w.out[-1].start_ms if w.out else end
    if covered > start + 1e-9:  # the chain reached work nothing earlier explains: the rest is untraced
        w.emit(w.out[-1].rank if w.out else last_r, "nothing traced", start, covered, "idle", "idle")
    segments = w.out[::-1]
    w.late_on_path(segments)
    busy = max(iv.length(iv.union((R.t.spans[i].start_ms, R.t.spans[i].end_ms) for i in R.idx))
               for R in ranks.values())
    return Path(step=step, start_ms=start, end_ms=end, segments=segments,
                crossings=sorted(w.crossings, key=lambda c: c.ready_ms), busy_ms=busy)


def critical_paths(traces, found: list[Instance]) -> list[Path]:
    """One path per step the traces hold (or one for the whole window when none marks steps)."""
    steps = sorted({s.step for t in traces for s in t.spans if s.step is not None})
    shared = {t.rank: TraceIndex(t) for t in traces}
    if not steps:
        p = critical_path(traces, found, None, shared)
        return [p] if p is not None else []
    return [p for n in steps if (p := critical_path(traces, found, n, shared)) is not None]


def _relabel(segments: list, rank: int, a: float, b: float, why: str) -> None:
    """Give the segments of `rank` inside [a, b] the why `why` (splitting those that straddle a or b), in place."""
    out = []
    for seg in segments:
        if seg.rank != rank or seg.end_ms <= a or seg.start_ms >= b or seg.why == "exposed comm":
            out.append(seg)
            continue
        for lo, hi, w in ((seg.start_ms, max(seg.start_ms, a), seg.why), (max(seg.start_ms, a), min(seg.end_ms, b), why),
                          (min(seg.end_ms, b), seg.end_ms, seg.why)):
            if hi > lo:
                out.append(Segment(seg.rank, seg.op, lo, hi, w, seg.kind))
    segments[:] = out


