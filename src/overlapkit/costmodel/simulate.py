"""A small event simulator of CUDA-like streams: where communication runs beside compute.

Tasks are issued in order, each to one stream of one rank. A stream runs its tasks one after
the other (FIFO, like a CUDA stream); a task starts when its stream is free and the tasks it
depends on have ended (like a CUDA event wait). A communication task may slow the compute that
runs beside it on the same rank (`contention`): compute then advances at 1/contention of its
speed while the transfer is in flight, which is how SM-driven collectives steal a GEMM's SMs.

Communication is assumed issued before the compute it overlaps (as CUDA_DEVICE_MAX_CONNECTIONS=1
makes the GPU honour), so when a compute task is placed, every transfer beside it is known.

The result converts to plain predicted spans (`predicted_spans`), which the tools layer draws with the
same picture as a measured timeline; the cost model itself never imports the analyzer.
"""

from __future__ import annotations

from dataclasses import dataclass

COMPUTE = "compute"
"""Kind of every computation task (the timeline's word for it)."""


@dataclass(frozen=True)
class Task:
    """One piece of work on one stream."""

    name: str
    """What runs: a GEMM chunk, a bucket's all-reduce."""
    kind: str
    """'compute' or a communication kind of overlapkit.timeline (tp_all_gather, ...)."""
    stream: str
    """Lane it runs on, e.g. 'compute', 'comm', 'p2p'."""
    duration_ms: float
    """Time it takes alone, without contention."""
    deps: tuple[int, ...] = ()
    """Indices of earlier tasks that must end first."""
    rank: int = 0
    """Rank (or pipeline stage) whose GPU runs it."""
    contention: float = 1.0
    """For communication: factor by which compute on this rank slows while it runs."""
    nbytes: int = 0
    """Bytes moved, for communication."""
    group_size: int = 1
    """Ranks in the communicating group."""


@dataclass(frozen=True)
class Placed:
    """A task with the times the simulation gave it."""

    task: Task
    """What ran."""
    start_ms: float
    """When it started, milliseconds from the schedule's start."""
    end_ms: float
    """When it ended (contention included)."""


def _finish(start: float, work: float, busy: list[tuple[float, float, float]]) -> float:
    """When compute of `work` ms started at `start` ends, slowed inside the `busy` intervals."""
    t = start
    for b0, b1, factor in busy:  # sorted, disjoint
        if b1 <= t:
            continue
        if b0 > t:  # free run until the next transfer
            if t + work <= b0:
                return t + work
            work -= b0 - t
            t = b0
        span = b1 - t
        if work * factor <= span:
            return t + work * factor
        work -= span / factor
        t = b1
    return t + work


def _busy_segments(intervals: list[tuple[float, float, float]]) -> list[tuple[float, float, float]]:
    """Disjoint segments with the largest contention of the transfers overlapping each."""
    if not intervals:
        return []
    events = sorted([(a, 1, c) for a, _, c in intervals] + [(b, -1, c) for _, b, c in intervals])
    active: dict[float, int] = {}
    segs: list[tuple[float, float, float]] = []
    for (a, step, c), (b, _, _) in zip(events, events[1:] + [(events[-1][0], 0, 1.0)]):
        active[c] = active.get(c, 0) + step
        f = max((x for x, count in active.items() if count > 0), default=1.0)
        if f > 1.0 and b > a:
            if segs and segs[-1][1] == a and segs[-1][2] == f:
                segs[-1] = (segs[-1][0], b, f)
            else:
                segs.append((a, b, f))
    return segs


def simulate(tasks: list[Task]) -> list[Placed]:
    """Place every task; raises on a dependency that is not an earlier task."""
    placed: list[Placed] = []
    stream_free: dict[tuple[int, str], float] = {}
    # Transfers per (rank, stream): one stream runs one at a time, so each list is sorted and
    # disjoint, and a compute stream only moves forward: a cursor skips what has ended.
    transfers: dict[tuple[int, str], list[tuple[float, float, float]]] = {}
    cursor: dict[tuple[int, str, str], int] = {}
    worst = 1.0
    for i, task in enumerate(tasks):
        if any(d < 0 or d >= i for d in task.deps):
            raise ValueError(f"task {i} ({task.name}) depends on {task.deps}: only earlier tasks are allowed")
        lane = (task.rank, task.stream)
        start = max([stream_free.get(lane, 0.0)] + [placed[d].end_ms for d in task.deps])
        if task.kind == COMPUTE:
            horizon = start + task.duration_ms * worst
            near = []
            for (rank, stream), ivs in transfers.items():
                if rank != task.rank:
                    continue
                key = (rank, task.stream, stream)
                j = cursor.get(key, 0)
                while j < len(ivs) and ivs[j][1] <= start:
                    j += 1
                cursor[key] = j
                while j < len(ivs) and ivs[j][0] < horizon:
                    near.append(ivs[j])
                    j += 1
            end = _finish(start, task.duration_ms, _busy_segments(near)) if near else start + task.duration_ms
        else:
            end = start + task.duration_ms
            if task.contention > 1.0 and end > start:
                transfers.setdefault(lane, []).append((start, end, task.contention))
                worst = max(worst, task.contention)
        stream_free[lane] = end
        placed.append(Placed(task, start, end))
    return placed


def makespan(placed: list[Placed]) -> float:
    """End of the last task, milliseconds."""
    return max((p.end_ms for p in placed), default=0.0)


PREDICTED_SPAN_KEYS = ("kind", "name", "stream", "start_ms", "end_ms", "rank", "nbytes", "group_size")
"""Keys of a predicted span: the fields a measured timeline span has (overlapkit.timeline.Span), so the
tools layer draws a prediction with the same picture as a measurement."""


def predicted_spans(placed: list[Placed]) -> list[dict]:
    """The simulated schedule as plain spans, one dict per task with PREDICTED_SPAN_KEYS."""
    return [{"kind": p.task.kind, "name": p.task.name, "stream": p.task.stream, "start_ms": p.start_ms,
             "end_ms": p.end_ms, "rank": p.task.rank, "nbytes": int(p.task.nbytes),
             "group_size": p.task.group_size} for p in placed]
