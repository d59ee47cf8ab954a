"""Where a pipeline step's time went on one rank: compute, the bubble (waiting for a neighbour that
has not sent yet) and exposed point-to-point transfer, told apart, from recorded spans.

The timeline report counts communication not under compute as exposed. In a pipeline that lumps
two things together: a receive posted early covers the neighbour's compute, and a stage waiting
in the warm-up is idle because of the schedule, not the wire. The engine re-stamps every receive
to start when its sender sent (see p2p.restamp_receives) and records the waits before that as
bubble intervals; here they are measured separately:

- bubble_ms = |waits before the neighbour sent| + the drain (this rank done, the last rank not
  yet), not counted as communication;
- p2p_ms = |pp_send ∪ pp_recv|, exposed_p2p_ms = the part not under compute and not bubble;
- steady_* = the same inside the steady state (first backward's start .. last forward's end).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..runtime import intervals as iv
from ..runtime.spans import Span
from .engine import StepTiming

P2P = ("pp_send", "pp_recv")


@dataclass(frozen=True)
class PipelineTimes:
    """One rank's step, split (milliseconds)."""

    step_ms: float
    """First action's start to the last span's end."""
    compute_ms: float
    bubble_ms: float
    p2p_ms: float
    exposed_p2p_ms: float
    steady_p2p_ms: float
    steady_exposed_p2p_ms: float
    other_exposed_comm_ms: float
    """Exposed communication of other kinds (TP, DP), outside the bubble."""

    @property
    def bubble_fraction(self) -> float:
        """Bubble over compute: the measured counterpart of (p-1)/(v·m)."""
        return self.bubble_ms / self.compute_ms if self.compute_ms > 0 else 0.0

    @property
    def steady_exposed_pct(self) -> float | None:
        return 100.0 * self.steady_exposed_p2p_ms / self.steady_p2p_ms if self.steady_p2p_ms > 0 else None


def pipeline_times(spans: list[Span], timing: StepTiming) -> PipelineTimes:
    """The split of one recorded step (`timing`) from the same rank's spans of that step."""
    mine = [s for s in spans if s.step == timing.step]
    start = min(a[3] for a in timing.actions)
    end = max([s.end_ms for s in mine] + [a[4] for a in timing.actions] + [b[1] for b in timing.bubbles])
    compute = iv.union((s.start_ms, s.end_ms) for s in mine if s.is_compute)
    bubble = iv.subtract(iv.union(timing.bubbles), compute)
    p2p = iv.union((s.start_ms, s.end_ms) for s in mine if s.kind in P2P)
    other = iv.union((s.start_ms, s.end_ms) for s in mine if s.is_comm and s.kind not in P2P)
    hidden_by = iv.union(compute + bubble)
    exposed = iv.subtract(p2p, hidden_by)
    steady = timing.steady
    clip = (lambda a: iv.clip(a, *steady)) if steady else (lambda a: [])
    return PipelineTimes(step_ms=end - start, compute_ms=iv.length(compute), bubble_ms=iv.length(bubble),
                         p2p_ms=iv.length(p2p), exposed_p2p_ms=iv.length(exposed),
                         steady_p2p_ms=iv.length(clip(p2p)), steady_exposed_p2p_ms=iv.length(clip(exposed)),
                         other_exposed_comm_ms=iv.length(iv.subtract(other, hidden_by)))
