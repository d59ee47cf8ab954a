"""From "how much overlapped" to "why, and what to change": seed 004 §15's diagnosis order on traces.

`analyze(traces)` gathers what §14 asks of a communication profile — which collectives cost
most, in which phase, whether compute covered them, bandwidth- or latency-bound, which ranks
are slower, which groups are slow — and `walk` turns it into §15's order, one verdict each:

1. is compute saturated?  2. communication's share of the step  3. which collectives
4. already overlapped?  5. topology and grouping  6. what to change (and, given the job's
configuration, what `overlapkit plan` predicts the change saves).

Each verdict is {check, verdict, evidence, try}: what was checked, the answer, the measured
figures behind it, and the switch to try (bucket size, prefetch depth,
CUDA_DEVICE_MAX_CONNECTIONS, overlap mode, parallel degrees, mapping).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from . import ranks as rk
from .bandwidth import bandwidth_rows, hardware_for
from .phases import exposed_by_phase
from .report import Report, report_traces

IDLE_SHARE = 0.15
"""Idle above this share of the step: compute is not saturated."""
EXPOSED_SHARE = 0.05
"""Exposed communication below this share of the step: communication is not the bottleneck."""
LOW_PEAK_PCT = 30.0
"""Bandwidth-bound collectives under this % of the link's peak point at the mapping."""


@dataclass
class Analysis:
    """Everything the diagnosis reads, per rank and across ranks (also the --json fields)."""

    report: Report
    bandwidth: list = field(default_factory=list)
    exposed_by_phase: list = field(default_factory=list)
    waits: dict = field(default_factory=dict)
    stragglers: list = field(default_factory=list)
    slow_groups: list = field(default_factory=list)
    hardware: str | None = None
    plan: object | None = None
    """The cost model's StepReport for the configuration the user stated, when one was."""


def analyze(traces, hardware: str | None = None, peak_gbps: float | None = None, plan=None) -> Analysis:
    """The report plus bandwidth, exposure by phase, waits, stragglers and slow groups of traces."""
    report = report_traces(traces)
    hw = hardware_for(next((t.gpu_name for t in traces if t.gpu_name), None), hardware)
    a = Analysis(report=report, hardware=hw.name if hw is not None else None, plan=plan)
    for t, row in zip(traces, report.ranks):
        a.bandwidth += bandwidth_rows(t.rank, t.spans, hw, peak_gbps)
        a.exposed_by_phase += exposed_by_phase(t.rank, t.spans, t.compute_known)
    if len({t.rank for t in traces}) == len(traces) > 1:
        a.waits = rk.rank_waits(traces, {r.rank: len(r.steps) for r in report.ranks})
        a.stragglers = rk.stragglers(a.waits, {r.rank: r.step_ms for r in report.ranks})
        a.slow_groups = rk.slow_groups(traces)
    return a


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B" if n > 0 else "? B"


def _switch(phase: str, kind: str, bound: str | None) -> str:
    """The switch that hides or shrinks exposed `kind` communication of `phase`."""
    if phase == "pipeline bubble":
        return ("pipeline: overlap the send/recv with the other micro-batch (overlap.pp=bulk, Megatron "
                "overlap_p2p_comm), interleaved 1F1B (vpp=2), more micro-batches per step")
    if kind == "send_recv":
        return ("all-to-all or point-to-point (an NCCL SendRecv kernel: embedding/expert exchange or pipeline "
                "transfers): chunk it against independent compute (overlap.ep=pipelined; overlap.pp=bulk)")
    if kind.startswith("ep_") or kind == "all_to_all":
        return "expert parallel: chunk dispatch/combine against the expert GEMMs (overlap.ep=pipelined)"
    if kind.startswith("tp_") or (phase == "forward" and kind in ("all_reduce", "reduce_scatter")):
        return ("tensor parallel: overlap='pipelined' or 'auto' in the TP layers (sequence parallelism first), "
                "CUDA_DEVICE_MAX_CONNECTIONS=1 so the collective is not queued behind GEMMs")
    if phase == "backward" or kind in ("dp_all_reduce", "dp_reduce_scatter"):
        if bound == "latency":
            return ("data parallel: bigger gradient buckets (DataParallel(bucket_mb=...), DDP bucket_cap_mb): "
                    "these all-reduces are latency-bound, fewer and larger ones cost less")
        return ("data parallel: reduce gradients during backward (DataParallel overlap, DDP), bucket size "
                "(bucket_mb / bucket_cap_mb: smaller buckets start sooner), a small first bucket for the tail")
    if kind in ("all_gather", "zero_all_gather") or phase == "optimizer":
        return ("ZeRO/FSDP: prefetch parameter gathers behind earlier layers (prefetch depth; overlap.zero="
                "pipelined, Megatron overlap_param_gather, FSDP2 forward prefetch)")
    return "overlap mode of the engine that issues it (overlap='bulk' or 'auto')"


def _top(a: Analysis, n: int = 3) -> list[dict]:
    """Collectives with the most exposed time per rank on average (over the ranks that ran them)."""
    agg: dict[tuple, list] = {}
    for r in a.exposed_by_phase:
        agg.setdefault((r["phase"], r["kind"], r["nbytes"]), []).append(r)
    ranks = max(1, len(a.report.ranks))
    rows = [dict(phase=k[0], kind=k[1], nbytes=k[2], exposed_ms=sum(x["exposed_ms"] for x in v) / ranks,
                 count=max(x["count"] for x in v)) for k, v in agg.items()]
    rows = sorted((r for r in rows if r["exposed_ms"] > 0), key=lambda r: -r["exposed_ms"])[:n]
    for r in rows:
        bw = [b for b in a.bandwidth if b.kind == r["kind"] and b.nbytes == r["nbytes"]]
        r["bandwidth"] = bw[0] if bw else None
    return rows


def _bw_text(b) -> str:
    if b is None or b.busbw_gbps is None:
        return "bus bandwidth unknown (no message size)"
    peak = f", {b.pct_of_peak:.0f}% of {b.link} peak, {b.bound}-bound" if b.pct_of_peak is not None else \
        " (peak unknown: give --hardware or --peak-gbps)"
    return f"busbw {b.busbw_gbps:.1f} GB/s{peak}"


def walk(a: Analysis) -> list[dict]:
    """Seed 004 §15's checks in order: [{check, verdict, evidence, try}]."""
    rows = a.report.ranks
    out: list[dict] = []
    if not rows:
        return out
    known = all(r.compute_known for r in rows)
    window = sum(r.total.step_ms for r in rows)
    idle = sum(r.total.idle_ms for r in rows) / window if window else 0.0
    compute = sum(r.total.compute_ms for r in rows) / window if window else 0.0
    if not known:
        out.append(dict(check="compute saturated", verdict="unknown",
                        evidence="the trace records no computation beside its transfers: " + "; ".join(rows[0].notes),
                        **{"try": "profile with CPU ops (or CUDA kernels) recorded"}))
        return out
    saturated = idle <= IDLE_SHARE
    out.append(dict(check="compute saturated", verdict="yes" if saturated else "no",
                    evidence=f"compute runs {100 * compute:.0f}% of the window, nothing runs {100 * idle:.0f}% "
                             f"(mean over {len(rows)} rank{'s' * (len(rows) > 1)})",
                    **{"try": "" if saturated else "find the host stall before tuning communication: input pipeline "
                       "(DataLoader workers), launch overhead (CUDA graphs, torch.compile), host syncs (.item())"}))
    comm = sum(r.total.comm_ms for r in rows) / window if window else 0.0
    exposed = sum(r.total.exposed_comm_ms for r in rows) / window if window else 0.0
    step = statistics.mean(r.step_ms for r in rows)
    per_step = statistics.mean(r.total.exposed_comm_ms / max(1, len(r.steps)) for r in rows)
    small = exposed < EXPOSED_SHARE
    out.append(dict(check="communication share of the step", verdict="small" if small else "large",
                    evidence=f"communication runs {100 * comm:.0f}% of the window, {100 * exposed:.0f}% exposed "
                             f"({per_step:.2f} ms of a {step:.2f} ms step)",
                    **{"try": "nothing on the communication side: exposed communication is not what limits this job"
                       if small else ""}))
    top = _top(a)
    ev = "; ".join(f"{r['phase']} {r['kind']} {_size(r['nbytes'])} x{r['count']}: {r['exposed_ms']:.2f} ms exposed "
                   f"per rank, {_bw_text(r['bandwidth'])}" for r in top) or "no exposed collective"
    first = top[0] if top else None
    switch = _switch(first["phase"], first["kind"], first["bandwidth"].bound if first and first["bandwidth"] else None) \
        if first else ""
    if small:
        switch = ""  # §15: a small exposed share ends the communication search; the figures stay as evidence
    out.append(dict(check="which collectives", verdict=f"{first['phase']} {first['kind']}" if first else "none exposed",
                    evidence=ev, **{"try": switch}))
    pct = [r.total.overlap_pct for r in rows if r.total.overlap_pct is not None]
    hidden = statistics.mean(pct) if pct else None
    verdict = "no communication" if hidden is None else "yes" if hidden >= 90 else "partly" if hidden >= 30 else "no"
    t_last = statistics.mean(r.total.t_last_ms / max(1, len(r.steps)) for r in rows)
    out.append(dict(check="already overlapped", verdict=verdict,
                    evidence=(f"{hidden:.1f}% of communication ran under compute (mean over ranks); "
                              f"{t_last:.2f} ms per step still runs after the last compute (T_last)")
                    if hidden is not None else "no communication in the trace",
                    **{"try": switch if verdict in ("no", "partly") else ""}))
    out.append(_topology(a))
    out.append(_what_to_change(a, out))
    return out


def _topology(a: Analysis) -> dict:
    notes, tries = [], []
    for s in a.stragglers:
        notes.append(f"rank {s['rank']} is {s['behind_ms']:.2f} ms/step behind: the others wait for it in collectives")
        tries.append(f"look at rank {s['rank']}'s own work first (uneven layers or data, a slow or throttled GPU)")
    for g in a.slow_groups:
        notes.append(f"group {g['group']} moves {g['kind']} {_size(g['nbytes'])} at {g['busbw_gbps']:.1f} GB/s, its peers "
                     f"at {g['peers_median_gbps']:.1f}")
        tries.append(f"map group {g['group']} onto one NVLink domain (TP inside a node, DP across nodes)")
    slow_links = [b for b in a.bandwidth if b.bound == "bandwidth" and b.pct_of_peak is not None
                  and b.pct_of_peak < LOW_PEAK_PCT]
    one_rank = len(a.report.ranks) < 2
    if slow_links:
        worst = min(slow_links, key=lambda b: b.pct_of_peak)
        notes.append(f"bandwidth-bound {worst.kind} {_size(worst.nbytes)} over {worst.group_size} ranks reaches "
                     f"{worst.pct_of_peak:.0f}% of {worst.link}" + (" (a lower bound: with one rank's trace the "
                     "transfer time includes waiting for the others)" if one_rank else ""))
        tries.append("check which link the group uses (nvidia-smi topo -m) and NCCL's choice (NCCL_DEBUG=INFO)")
    if a.waits:
        notes.append("waiting inside collectives, ms/step: " + ", ".join(f"rank {r} {w:.2f}" for r, w in sorted(a.waits.items())))
    verdict = "mismatch" if a.stragglers or a.slow_groups or slow_links else ("fits" if a.waits or a.bandwidth else "unknown")
    if one_rank:
        verdict = "unknown"
        notes.append("one rank's trace: give every rank's trace (a directory) to compare ranks and groups")
    return dict(check="topology and grouping", verdict=verdict, evidence="; ".join(notes), **{"try": "; ".join(tries)})


def _what_to_change(a: Analysis, checks: list[dict]) -> dict:
    first = next((c for c in checks if c["try"]), None)
    evidence = f"first open check: {first['check']}" if first else "every check passed"
    verdict = first["try"].split(":")[0] if first else "nothing"
    if a.plan is not None:
        recs = getattr(a.plan, "recommendations", []) or []
        if recs:
            evidence += "; overlapkit plan on the stated configuration predicts: " + "; ".join(
                f"{r.switch} saves {r.saving_pct:.1f}% ({r.saving_s * 1e3:.1f} ms per step)" for r in recs[:3])
        else:
            evidence += "; overlapkit plan on the stated configuration finds no switch that saves time"
    return dict(check="what to change", verdict=verdict, evidence=evidence,
                **{"try": first["try"] if first else ""})
