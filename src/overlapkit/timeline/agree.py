"""Check that the engines' recorder and a profiler trace saw the same overlap.

Both sources see overlapkit's own spans: the recorder stamps them, the trace holds the
kernels (GPU) or ranges (CPU) that ran inside them. Each traced span must lie inside the
recorded span of the same kind (and, for compute, the same name), up to a tolerance: a
recorded span is issue-to-completion, the traced work runs somewhere inside it.

A computation's traced time (its range, less the waits inside it) must equal its recorded time
(its stamps, less the waits the recorder saw) within the tolerance: both sources carve out the
same marked waits. A pipeline bubble (`pp_bubble`: the recorder derives it from a receive wait
and its peer's send time, or from the drain after this rank's last action) has no range of its
own: it is idle time, so no traced computation may run inside it. A pipeline receive is recorded
from its peer's send on (what it waited before that is bubble), while its profiler range opens at
the post: the two are paired by their ends, and the traced one may start earlier.

One exception is not a disagreement: on CPU the recorder stamps a transfer's end when its
future completes, and gloo closes its profiler range just after that, on its own thread, so a
traced transfer may end a little (a preemption, under load) after its record.

Nor is the profiler's window edge: a transfer issued just before the profiler stopped (ZeRO's parameter
gather for the next step, in flight across the step boundary) is recorded from issue to completion, while
gloo's range for it opens and closes after the profiler stopped, so the trace never holds it. Given the
window's end, a recorded span still running then with no traced span is `cut`, not `missing`.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from ..runtime.spans import COMM_KINDS, Span


@dataclass(frozen=True)
class SpanAgreement:
    """How a recorder's spans and a trace's spans of one rank correspond."""

    matched: int
    """Recorded spans that hold at least one traced span."""
    missing: list[str]
    """Recorded spans (kind:name@start) with no traced span inside them."""
    unmatched: list[str]
    """Traced overlapkit spans inside no recorded span."""
    early_ms: float
    """The most a matched traced span starts before its recorded span (0 when none does)."""
    late_compute_ms: float
    """The most a traced computation ends after its recorded span."""
    late_comm_ms: float
    """The most a traced transfer ends after its recorded span."""
    offset_ms: float
    """Trace time minus recorder time, as used."""
    compute_diff_ms: float = 0.0
    """The most a recorded computation's time differs from the traced time of its name inside it."""
    worst_compute: str = ""
    """The computation (name@start ms, recorded vs traced ms) that differs by `compute_diff_ms`."""
    cut: list[str] = ()
    """Recorded spans (kind:name@start) still running when the profiler's window ended, with no traced span:
    the profiler never saw them run to their end, so their absence is not a disagreement."""

    def ok(self, tol_ms: float, comm_end_tol_ms: float | None = None) -> bool:
        """Everything paired, inside its record and as long as it within `tol_ms` (transfer ends:
        `comm_end_tol_ms`)."""
        late_comm = tol_ms if comm_end_tol_ms is None else comm_end_tol_ms
        return (not self.missing and not self.unmatched and self.early_ms <= tol_ms
                and self.late_compute_ms <= tol_ms and self.late_comm_ms <= late_comm
                and self.compute_diff_ms <= tol_ms)


POSTED_EARLY = ("pp_recv",)
"""Kinds whose record starts after their profiler range opens: a receive posted before its peer sent."""


def _key(s: Span) -> tuple[str, str]:
    return (s.kind, s.name if s.is_compute else "")


def ours(traced: list[Span], recorded: list[Span]) -> list[Span]:
    """The traced spans that overlapkit itself marked: our kinds of transfer, our computations' names."""
    names = {s.name for s in recorded if s.is_compute}
    return [s for s in traced if (s.is_compute and s.name in names) or s.kind in COMM_KINDS]


def estimate_offset(recorded: list[Span], traced: list[Span]) -> float:
    """Trace time minus recorder time, from the first occurrence of each computation in both.

    For clocks with no common origin (CUDA events and a GPU trace): the first kernel of a
    computation starts just after the event recorded before it.
    """
    first_rec: dict[str, float] = {}
    first_tr: dict[str, float] = {}
    for s in sorted(recorded, key=lambda s: s.start_ms):
        if s.is_compute:
            first_rec.setdefault(s.name, s.start_ms)
    for s in sorted(traced, key=lambda s: s.start_ms):
        if s.is_compute:
            first_tr.setdefault(s.name, s.start_ms)
    shared = [first_tr[n] - first_rec[n] for n in first_rec if n in first_tr]
    if not shared:
        raise ValueError("no computation appears in both the recorder's spans and the trace's")
    return statistics.median(shared)


def compare_spans(recorded: list[Span], traced: list[Span], offset_ms: float | None = None,
                  tol_ms: float = 0.5, window_end_ms: float | None = None) -> SpanAgreement:
    """Pair each traced overlapkit span with the recorded span of its kind it ran under.

    Traced spans are taken in start order; each goes to the earliest recorded span of its kind
    (and name) that started before it (within `tol_ms`) and holds no traced span yet, because
    work runs in issue order; when every such span already holds one, to the latest of them
    that it starts inside (the second copy of an exchange, the next kernel of a GEMM).
    `offset_ms` is trace time minus recorder time (estimated from computations when None).
    A pipeline receive goes by its end instead (see the module doc); a bubble pairs with the
    absence of traced computation inside it. `window_end_ms` (trace time: the last ProfilerStep's end,
    `Trace.step_ranges`) sets apart the recorded spans the window cut (see the module doc).
    """
    bubbles = [s for s in recorded if s.kind == "pp_bubble"]
    recorded = [s for s in recorded if s.is_compute or s.is_comm]
    traced = ours(traced, recorded)
    if offset_ms is None:
        offset_ms = estimate_offset(recorded, traced)
    records: dict[tuple[str, str], list[Span]] = {}
    for r in sorted(recorded, key=lambda s: s.start_ms):
        records.setdefault(_key(r), []).append(r)
    held: dict[int, list[Span]] = {}
    unmatched = []
    traced = sorted((s.shifted(offset_ms) for s in traced), key=lambda s: s.start_ms)
    for t in traced:
        at = t.end_ms if t.kind in POSTED_EARLY else t.start_ms
        began = [r for r in records.get(_key(t), []) if r.start_ms - tol_ms <= at]
        owner = next((r for r in began if id(r) not in held), None)
        if owner is None:
            owner = next((r for r in reversed(began) if t.start_ms <= r.end_ms + tol_ms), None)
        if owner is None:
            unmatched.append(f"{t.kind}:{t.name}@{t.start_ms:.3f}")
        else:
            held.setdefault(id(owner), []).append(t)
    early = late_compute = late_comm = 0.0
    missing, cut = [], []
    edge = None if window_end_ms is None else window_end_ms - offset_ms  # in recorder time, as the records
    diff, worst = 0.0, ""
    for r in sorted(recorded, key=lambda s: s.start_ms):
        if id(r) not in held:
            (cut if edge is not None and r.end_ms > edge else missing).append(f"{r.kind}:{r.name}@{r.start_ms:.3f}")
        for t in held.get(id(r), []):
            if r.kind not in POSTED_EARLY:
                early = max(early, r.start_ms - t.start_ms)
            if r.is_compute:
                late_compute = max(late_compute, t.end_ms - r.end_ms)
            else:
                late_comm = max(late_comm, t.end_ms - r.end_ms)
        if r.is_compute and id(r) in held:
            inside = sum(t.duration_ms for t in held[id(r)])
            if abs(r.duration_ms - inside) > diff:
                diff = abs(r.duration_ms - inside)
                worst = f"{r.name}@{r.start_ms:.3f}: recorded {r.duration_ms:.3f} ms, traced {inside:.3f} ms"
    matched = len(held)
    computed = [t for t in traced if t.is_compute]
    for b in bubbles:
        busy = sum(max(0.0, min(b.end_ms, t.end_ms) - max(b.start_ms, t.start_ms)) for t in computed)
        if busy <= tol_ms:
            matched += 1
        else:
            missing.append(f"{b.kind}:{b.name}@{b.start_ms:.3f} (computing {busy:.3f} ms of it)")
    return SpanAgreement(matched=matched, missing=missing, unmatched=unmatched, early_ms=early,
                         late_compute_ms=late_compute, late_comm_ms=late_comm, offset_ms=offset_ms, cut=cut,
                         compute_diff_ms=diff, worst_compute=worst)
