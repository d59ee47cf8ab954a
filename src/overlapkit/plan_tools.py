"""Where `overlapkit plan` meets the timeline: predicted spans drawn with the measured picture, and a
user's profiler traces read into the plain numbers the cost model calibrates on.

The cost model and the trace analyzer do not import each other; this tools-layer module joins them.
"""

from __future__ import annotations

import re
from collections import defaultdict

GEMM_NAME = re.compile(r"(?:^|[./_ ])(qkv|proj|fc1|fc2|lm_head|head)[./_ ](?:bwd[./_ ])?(fwd|dgrad|wgrad)\b")
"""A compute range naming one layer GEMM and its phase (overlapkit's `blocks.0.attn.qkv.fwd.gemm`,
`blocks.1.mlp.fc1.bwd.wgrad`, `head.bwd.dgrad`)."""


def draw_spans(spans: list[dict], path: str, title: str) -> str:
    """Draw predicted spans (costmodel.simulate.predicted_spans) with the timeline's picture."""
    from overlapkit.timeline import Span, plot_spans

    plot_spans([Span(**s) for s in spans], path, title=title)
    return path


def read_measured(trace_dir: str):
    """One traced layout's numbers per step on its slowest rank (costmodel.calibrate.Measured), read with
    the analyzer's reader and report. Raises ValueError (one line) on traces it cannot use."""
    from overlapkit.costmodel.calibrate import COMM_FOLLOWS_ON, Measured
    from overlapkit.timeline import read_traces, report_traces

    traces = read_traces([trace_dir])
    report = report_traces(traces)
    rows = []
    for rank in report.ranks:
        times = [t for _, t in rank.steps] or [rank.total]
        rows.append((sum(t.step_ms for t in times) / len(times), rank, times))
    step_ms, rank, times = max(rows, key=lambda r: r[0])
    n = len(times)
    if not rank.compute_known:
        raise ValueError(f"{rank.source}: the trace records no computation; calibration needs compute spans "
                         f"(profile with CPU ops or CUDA kernels)")
    spans = [s for t in traces for s in t.spans if s.rank == rank.rank and (s.step is not None or not rank.steps)]
    gemm: dict = defaultdict(lambda: [0.0, 0])
    for s in spans:
        if s.is_compute and (m := GEMM_NAME.search(s.name)):
            key = ("lm_head" if m.group(1) == "head" else m.group(1), m.group(2))
            gemm[key][0] += s.duration_ms / n
            gemm[key][1] += 1
    comm = {r.kind: (r.comm_ms / n, (r.exposed_ms or 0.0) / n, r.count / n, r.nbytes // max(1, r.count))
            for r in rank.by_kind}
    optimizer = sum(s.duration_ms for s in spans if s.is_compute and s.phase == "optimizer") / n
    mine = [t for t in traces if t.rank == rank.rank]
    device = mine[0].device
    return Measured(step_ms=step_ms, compute_ms=sum(t.compute_ms for t in times) / n,
                    idle_ms=sum(t.idle_ms for t in times) / n,
                    gemm={k: (ms, calls / n) for k, (ms, calls) in gemm.items()}, comm=comm, steps=n,
                    ranks=len(report.ranks), device=device,
                    host_busy_ms=host_busy_ms(mine) if device == "gpu" else None, optimizer_ms=optimizer or None,
                    optimizer_host_ms=host_busy_ms(mine, "optimizer") if device == "gpu" and optimizer else None,
                    comm_follows=COMM_FOLLOWS_ON[device])


def host_busy_ms(traces, phase: str | None = None) -> float | None:
    """The host's own time per profiled step of one rank's GPU traces: each ProfilerStep (with `phase`, only
    its CPU ranges marking that phase: the optimizer's step) less the time its threads sat in a synchronization
    with the GPU (cudaStreamSynchronize, a blocking copy, ...) or in a kernel launch waiting for room in the
    GPU's queue (Trace.launch_waits). None without ProfilerStep ranges."""
    from overlapkit.runtime import intervals as iv

    busy = []
    for t in traces:
        all_syncs = iv.union((x, y) for _, x, y in (*t.host_syncs, *getattr(t, "launch_waits", ())))
        all_marked = iv.union((x, y) for _, x, y, p in getattr(t, "phase_ranges", ()) if p == phase) if phase else []
        for a, b in (r for n, r in t.step_ranges.items() if n in t.steps):
            syncs = iv.clip(all_syncs, a, b)
            if phase is None:
                busy.append((b - a) - iv.length(syncs))
                continue
            marked = iv.clip(all_marked, a, b)
            busy.append(iv.length(marked) - iv.length(iv.intersect(marked, syncs)))
    return sum(busy) / len(busy) if busy else None
