"""Exposed communication per serving step: a trace or a recording cut into its prefill and decode steps, one row per kind.

Nothing here overlaps anything; it says how much communication each kind of serving step left exposed
(a decode step has little computation to hide its all-reduces or all-to-alls behind, a prefill much more).

**The rule that cuts a trace into steps.** A step is an outermost CPU range whose name, less an
`overlapkit.compute.` prefix, is `prefill` or `decode`, alone or followed by a non-letter and anything
(any case): a user's `record_function("prefill")`, `record_function("decode_step")`, `decode#12`, or the
`overlapkit.compute.prefill` / `overlapkit.compute.decode` range overlapkit's inference forwards open.
Its kind is that word (`decoder_layer` is not a step). `ProfilerStep#N` ranges say nothing of the kind
and do not cut serving steps: mark each forward. The work of a step is what was issued inside its range
(a kernel by its launch, so one that runs after the range closed still counts; a CPU span by its start).
Its exposed communication is the union of its communication less the union of its computation (the
report's definition); its length runs from the range's start to the later of the range's end and its
work's last end. In a recorder's spans a step is a step number (`Recorder.next_step`) holding a compute
span named `prefill` or `decode`, which is what the inference forwards record.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import asdict, dataclass

from ..runtime import intervals as iv
from ..runtime.spans import COMPUTE_RANGE_PREFIX

STEP_KINDS = ("prefill", "decode")
"""The kinds of serving step, in the order their rows are printed."""
_STEP = re.compile(r"(prefill|decode)(?![a-z])", re.IGNORECASE)


def step_kind(name: str) -> str | None:
    """`prefill` / `decode` when a range of this name is a serving step (see the module's rule), else None."""
    m = _STEP.match(name, len(COMPUTE_RANGE_PREFIX) if name.startswith(COMPUTE_RANGE_PREFIX) else 0)
    return m.group(1).lower() if m is not None else None


def outermost_steps(ranges) -> list[tuple]:
    """(start, end, kind) of the step ranges (thread, start, end, kind) no other step range encloses, by start."""
    out: list[tuple] = []
    for _, a, b, kind in sorted(ranges, key=lambda r: (r[1], -r[2])):
        if not out or a >= out[-1][1]:
            out.append((a, b, kind))
    return out


@dataclass(frozen=True)
class StepKindRow:
    """One kind of serving step on one rank: how many, and their mean length, communication and exposed part."""

    rank: int
    """The rank whose trace or recording it was read from."""
    kind: str
    """prefill or decode."""
    steps: int
    """Steps of this kind."""
    step_ms: float
    """Mean length of a step (ms)."""
    comm_ms: float
    """Mean communication time of a step: the union of its transfers (ms)."""
    exposed_ms: float
    """Mean exposed communication of a step: its transfers less its computation (ms)."""


def _row(kind: str, start: float, end: float, work) -> dict:
    comm = iv.union((s.start_ms, s.end_ms) for s in work if s.is_comm)
    compute = iv.union((s.start_ms, s.end_ms) for s in work if s.is_compute)
    end = max([end] + [s.end_ms for s in work])
    return dict(kind=kind, step_ms=end - start, comm_ms=iv.length(comm), exposed_ms=iv.length(iv.subtract(comm, compute)),
                comm_spans=sum(1 for s in work if s.is_comm))


def trace_steps(trace) -> list[dict]:
    """Per serving step of one read trace (`timeline.trace.Trace`): {kind, step_ms, comm_ms, exposed_ms, comm_spans}."""
    windows = trace.serving_ranges
    starts = [w[1] for w in windows]
    work: list[list] = [[] for _ in windows]
    for s, how in zip(trace.spans, trace.issue or [None] * len(trace.spans)):
        t = how[1] if how is not None else s.start_ms
        i = bisect.bisect_right(starts, t) - 1
        if i >= 0 and t <= windows[i][2]:
            work[i].append(s)
    return [_row(kind, a, b, w) for (kind, a, b), w in zip(windows, work)]


def recorded_steps(spans) -> list[dict]:
    """Per serving step of a recorder's spans: {step, kind, step_ms, comm_ms, exposed_ms, comm_spans}; a step
    number without a compute span named prefill or decode is left out. comm_spans: the step's communication
    spans (a recording: one per collective; a trace: one per kernel or CPU range of one)."""
    by_step: dict[int, list] = {}
    for s in spans:
        if s.step is not None:
            by_step.setdefault(s.step, []).append(s)
    out = []
    for step, mine in sorted(by_step.items()):
        marks = [s for s in mine if s.is_compute and s.name in STEP_KINDS]
        if marks:
            row = _row(marks[0].name, min(s.start_ms for s in marks), max(s.end_ms for s in marks), mine)
            out.append(dict(step=step, **row))
    return out


def by_kind(rank: int, steps: list[dict]) -> list[StepKindRow]:
    """The steps' means, one row per kind present (prefill first)."""
    out = []
    for kind in STEP_KINDS:
        mine = [s for s in steps if s["kind"] == kind]
        if mine:
            n = len(mine)
            out.append(StepKindRow(rank, kind, n, *(sum(s[f] for s in mine) / n
                                                    for f in ("step_ms", "comm_ms", "exposed_ms"))))
    return out


def serving_rows(traces) -> list[StepKindRow]:
    """Every trace's rows (none for a trace without serving steps)."""
    return [r for t in traces if t.serving_ranges for r in by_kind(t.rank, trace_steps(t))]


def serving_table(traces) -> list[tuple]:
    """The `overlapkit analyze` table of exposed communication per serving step ([] when no trace has steps)."""
    rows = serving_rows(traces)
    if not rows:
        return []
    return [("Exposed communication per serving step", ["rank", "step", "steps", "mean step ms", "mean comm ms",
                                                        "mean exposed ms", "exposed % of step"],
             [[str(r.rank), r.kind, str(r.steps), f"{r.step_ms:.3f}", f"{r.comm_ms:.3f}", f"{r.exposed_ms:.3f}",
               f"{100 * r.exposed_ms / r.step_ms:.1f}" if r.step_ms > 0 else "-"] for r in rows])]


def serving_json(traces) -> list[dict]:
    """The rows of `serving_table` for --json."""
    return [asdict(r) for r in serving_rows(traces)]
