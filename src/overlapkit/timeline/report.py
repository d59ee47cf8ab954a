"""How much communication was hidden behind computation, per rank and per step, from spans.

One function measures every source: the engines' recorder and profiler traces both become
`Span`s, and `report_spans` turns spans into the same numbers. Definitions (docs/timeline.md
says the same with examples), for the spans of one rank inside a window:

- C = union of compute spans (all streams), M = union of communication spans;
- compute_ms = |C|, comm_ms = |M|, hidden_ms = |M ∩ C|, exposed_comm_ms = |M \\ C|;
- overlap_pct = 100 · hidden_ms / comm_ms (None without communication);
- step_ms = last end − first start of the window's spans; idle_ms = step_ms − |any span|;
- t_last_ms = |M after the end of the last compute span| (all of M when there is no compute);
- bubble_ms = |pp_bubble spans \\ C|: a pipeline stage waiting for a neighbour that has not sent yet
  (recorded by the pipeline engine; not communication, so apart from exposed_comm_ms).

When the source records no computation to judge by (`Trace.compute_known` is False: a CPU
trace without ops), hidden, exposed, overlap and T_last are None ("unknown"), never 0 %.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field

from ..runtime import intervals as iv
from ..runtime.spans import Span


@dataclass(frozen=True)
class Times:
    """The overlap numbers of one window (a step, or a rank's whole record)."""

    step_ms: float
    compute_ms: float
    comm_ms: float
    hidden_ms: float | None
    exposed_comm_ms: float | None
    overlap_pct: float | None
    idle_ms: float
    t_last_ms: float | None
    bubble_ms: float = 0.0
    """Pipeline bubble: |pp_bubble spans \\ compute|, a stage waiting for a neighbour that has not sent
    yet. Not communication, so not in exposed_comm_ms' definition; shown beside it."""


@dataclass(frozen=True)
class KindRow:
    """Communication of one kind (and, in `by_size`, one message size) on one rank."""

    kind: str
    count: int
    nbytes: int
    """Message size in `by_size`; total bytes of all transfers in `by_kind`; 0 when unknown."""
    comm_ms: float
    exposed_ms: float | None
    overlap_pct: float | None


@dataclass(frozen=True)
class StreamRow:
    """What ran on one stream (lane) of one rank."""

    stream: str
    count: int
    busy_ms: float
    compute_ms: float
    comm_ms: float
    exposed_ms: float | None


@dataclass(frozen=True)
class RankReport:
    """Everything measured on one rank (one trace, or one rank's recorded spans)."""

    rank: int
    source: str
    total: Times
    """Over all the rank's spans."""
    steps: list[tuple[int, Times]]
    """Per step, for spans that know their step."""
    by_kind: list[KindRow]
    by_size: list[KindRow]
    by_stream: list[StreamRow]
    compute_known: bool = True
    """False when the source holds no computation: overlap is unknown (None), not 0."""
    notes: tuple[str, ...] = ()
    """What the reader assumed or could not see."""

    @property
    def step_ms(self) -> float:
        """Mean step time over the steps; the whole window when steps are unknown."""
        return sum(t.step_ms for _, t in self.steps) / len(self.steps) if self.steps else self.total.step_ms

    def to_dict(self) -> dict:
        out = {"rank": self.rank, "source": self.source, "step_ms": self.step_ms,
               "n_steps": len(self.steps), "window_ms": self.total.step_ms}
        out.update({k: v for k, v in asdict(self.total).items() if k != "step_ms"})
        out["by_kind"] = {r.kind: _kind_dict(r) for r in self.by_kind}
        out["by_size"] = [asdict(r) for r in self.by_size]
        out["by_stream"] = [asdict(r) for r in self.by_stream]
        out["steps"] = [dict(step=n, **asdict(t)) for n, t in self.steps]
        out["compute_known"], out["notes"] = self.compute_known, list(self.notes)
        return out


def _kind_dict(r: KindRow) -> dict:
    return {k: v for k, v in asdict(r).items() if k != "kind"}


@dataclass(frozen=True)
class Report:
    """One row per rank (or per trace), and which of them is slowest."""

    ranks: list[RankReport] = field(default_factory=list)

    @property
    def slowest(self) -> RankReport | None:
        """The rank with the longest mean step, when several distinct ranks were measured."""
        if len(self.ranks) < 2 or len({r.rank for r in self.ranks}) < len(self.ranks):
            return None
        return max(self.ranks, key=lambda r: (r.step_ms, -r.rank))

    def to_dict(self) -> dict:
        slow = self.slowest
        return {"ranks": [r.to_dict() for r in self.ranks],
                "slowest_rank": slow.rank if slow is not None else None}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


def _pct(part: float, whole: float) -> float | None:
    return 100.0 * part / whole if whole > 0 else None


def measure(spans: list[Span], compute_known: bool = True) -> Times:
    """The overlap numbers of one window of one rank's spans (unknown ones None without compute)."""
    if not spans:
        return Times(0.0, 0.0, 0.0, 0.0, 0.0, None, 0.0, 0.0)
    compute = iv.union((s.start_ms, s.end_ms) for s in spans if s.is_compute)
    comm = iv.union((s.start_ms, s.end_ms) for s in spans if s.is_comm)
    busy = iv.union((s.start_ms, s.end_ms) for s in spans)
    start, end = min(s.start_ms for s in spans), max(s.end_ms for s in spans)
    comm_ms, hidden = iv.length(comm), iv.length(iv.intersect(comm, compute))
    tail_from = compute[-1][1] if compute else start
    bubble = iv.length(iv.subtract(iv.union((s.start_ms, s.end_ms) for s in spans if s.kind == "pp_bubble"), compute))
    if not compute_known:
        return Times(step_ms=end - start, compute_ms=iv.length(compute), comm_ms=comm_ms, hidden_ms=None,
                     exposed_comm_ms=None, overlap_pct=None, idle_ms=(end - start) - iv.length(busy),
                     t_last_ms=None, bubble_ms=bubble)
    return Times(step_ms=end - start, compute_ms=iv.length(compute), comm_ms=comm_ms, hidden_ms=hidden,
                 exposed_comm_ms=comm_ms - hidden, overlap_pct=_pct(hidden, comm_ms),
                 idle_ms=(end - start) - iv.length(busy),
                 t_last_ms=iv.length(iv.clip(comm, tail_from, end)), bubble_ms=bubble)


def _kind_row(kind: str, spans: list[Span], compute: iv.Intervals | None, nbytes: int) -> KindRow:
    comm = iv.union((s.start_ms, s.end_ms) for s in spans)
    comm_ms = iv.length(comm)
    if compute is None:
        return KindRow(kind=kind, count=len(spans), nbytes=nbytes, comm_ms=comm_ms, exposed_ms=None,
                       overlap_pct=None)
    exposed = iv.length(iv.subtract(comm, compute))
    return KindRow(kind=kind, count=len(spans), nbytes=nbytes, comm_ms=comm_ms, exposed_ms=exposed,
                   overlap_pct=_pct(comm_ms - exposed, comm_ms))


def _rank_report(rank: int, spans: list[Span], source: str, compute_known: bool = True,
                 notes: tuple[str, ...] = ()) -> RankReport:
    compute = iv.union((s.start_ms, s.end_ms) for s in spans if s.is_compute)
    known = compute if compute_known else None
    by_step: dict[int, list[Span]] = defaultdict(list)
    by_kind: dict[str, list[Span]] = defaultdict(list)
    by_size: dict[tuple[str, int], list[Span]] = defaultdict(list)
    by_stream: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        by_stream[s.stream].append(s)
        if s.step is not None:
            by_step[s.step].append(s)
        if s.is_comm:
            by_kind[s.kind].append(s)
            by_size[(s.kind, s.nbytes)].append(s)
    kinds = [_kind_row(k, ss, known, sum(s.nbytes for s in ss)) for k, ss in by_kind.items()]
    sizes = [_kind_row(k, ss, known, n) for (k, n), ss in by_size.items()]
    streams = []
    for name, ss in by_stream.items():
        comm = iv.union((s.start_ms, s.end_ms) for s in ss if s.is_comm)
        streams.append(StreamRow(
            stream=name, count=len(ss), busy_ms=iv.length(iv.union((s.start_ms, s.end_ms) for s in ss)),
            compute_ms=iv.length(iv.union((s.start_ms, s.end_ms) for s in ss if s.is_compute)),
            comm_ms=iv.length(comm),
            exposed_ms=iv.length(iv.subtract(comm, compute)) if compute_known else None))
    return RankReport(rank=rank, source=source, total=measure(spans, compute_known),
                      steps=[(n, measure(ss, compute_known)) for n, ss in sorted(by_step.items())],
                      by_kind=sorted(kinds, key=lambda r: -(r.exposed_ms if compute_known else r.comm_ms)),
                      by_size=sorted(sizes, key=lambda r: (r.kind, r.nbytes)),
                      by_stream=sorted(streams, key=lambda r: r.stream), compute_known=compute_known,
                      notes=tuple(notes))


def report_spans(spans: list[Span], source: str = "recorder") -> Report:
    """The report of spans from any source: one row per rank found in `spans`."""
    by_rank: dict[int, list[Span]] = defaultdict(list)
    for s in spans:
        by_rank[s.rank].append(s)
    return Report([_rank_report(r, ss, source) for r, ss in sorted(by_rank.items())])


def report_traces(traces) -> Report:
    """The report of profiler traces: one row per trace (traces of different jobs may share a rank)."""
    rows = []
    for t in traces:
        by_rank: dict[int, list[Span]] = defaultdict(list)
        for s in t.spans:
            by_rank[s.rank].append(s)
        rows += [_rank_report(r, ss, t.path, t.compute_known, tuple(t.notes)) for r, ss in sorted(by_rank.items())]
    return Report(rows)


@dataclass(frozen=True)
class LoadImbalance:
    """Expert-parallel load of one MoE layer in one step: rows each expert and each EP rank computed.

    An all-to-all waits for its slowest rank, so max/mean of the per-rank load is the factor by
    which expert compute (and the exposed transfer of the others) grows over a balanced router.
    """

    per_expert: list[int]
    """Rows (token, choice assignments) each expert computed, global expert order."""
    per_rank: list[int]
    """Rows each EP rank's experts computed, rank order."""
    dropped: int = 0
    """Assignments the capacity factor dropped (never computed), over all ranks."""

    @property
    def expert_max_over_mean(self) -> float | None:
        mean = sum(self.per_expert) / len(self.per_expert) if self.per_expert else 0
        return max(self.per_expert) / mean if mean else None

    @property
    def rank_max_over_mean(self) -> float | None:
        mean = sum(self.per_rank) / len(self.per_rank) if self.per_rank else 0
        return max(self.per_rank) / mean if mean else None

    def line(self) -> str:
        fmt = lambda v: "—" if v is None else f"{v:.2f}"  # noqa: E731
        return (f"tokens per expert {self.per_expert} (max/mean {fmt(self.expert_max_over_mean)}), per EP rank "
                f"{self.per_rank} (max/mean {fmt(self.rank_max_over_mean)}), dropped {self.dropped}")


def load_imbalance(received_per_rank: list[list[int]], dropped: int = 0) -> LoadImbalance:
    """The load of one MoE layer from each EP rank's rows per local expert, in rank order
    (`MoE.last_load.received_per_expert` of every rank)."""
    return LoadImbalance(per_expert=[n for rank in received_per_rank for n in rank],
                         per_rank=[sum(rank) for rank in received_per_rank], dropped=dropped)
