"""From "how much overlapped" to "why, and what to change": a diagnosis walk on traces.

`analyze(traces)` gathers what a communication profile should answer — which collectives cost
most, in which phase, whether compute covered them, bandwidth- or latency-bound, which ranks
are slower, which groups are slow, the cross-rank critical path and what-ifs on it — and `walk`
turns it into one verdict per check, in this order:

1. is compute saturated?  2. communication's share of the step  3. which collectives
4. already overlapped?  5. topology and grouping  6. the critical path  7. what to change (and,
given the job's configuration, what `overlapkit plan` predicts the change saves).

Each verdict is {check, verdict, evidence, try}: what was checked, the answer, the measured
figures behind it, and the switch to try — fitted to the job the trace shows
(`timeline/framework.py`, `timeline/advice.py`): nothing already on, nothing the device lacks.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from . import advice
from . import ranks as rk
from . import whatif
from .bandwidth import bandwidth_rows, check_peak
from .collectives import align, instances
from .critical_path import critical_paths
from .framework import Job
from .messages import size_text
from .phases import exposed_by_phase
from .report import Report, report_traces

IDLE_SHARE = 0.15
"""Idle above this share of the step: compute is not saturated."""
EXPOSED_SHARE = 0.05
"""Exposed communication below this share of the step: communication is not the bottleneck."""
LOW_PEAK_PCT = 30.0
"""Bandwidth-bound collectives under this % of the link's peak point at the mapping."""
CHECKS = ("compute saturated", "communication share of the step", "which collectives", "already overlapped",
          "topology and grouping", "critical path", "what to change")


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
    job: Job | None = None
    """Framework, device and what the job already does."""
    clock_offsets: dict = field(default_factory=dict)
    """Per rank, ms added to its times so that its collectives end with the others' (timeline/collectives.py)."""
    paths: list = field(default_factory=list)
    """The critical path of each step (timeline/critical_path.py)."""
    what_if: list = field(default_factory=list)
    """[{question, saving_ms, step_ms, measured_ms}] on the paths (timeline/whatif.py), biggest saving first."""


def analyze(traces, links=None, peak_gbps: float | None = None, plan=None, critical: bool = True) -> Analysis:
    """The report plus bandwidth, exposure by phase, waits, stragglers, slow groups, the critical path and
    what-ifs of the traces of one job. `links`: a bandwidth.Links for the link peaks (None: unknown unless
    `peak_gbps`). Aligns the traces' clocks on their collectives (in place)."""
    check_peak(peak_gbps)
    report = report_traces(traces)
    a = Analysis(report=report, hardware=links.name if links is not None else None, plan=plan, job=Job.of(traces))
    for t in traces:
        a.bandwidth += bandwidth_rows(t.rank, t.spans, links, peak_gbps)
        a.exposed_by_phase += exposed_by_phase(t.rank, t.spans, t.compute_known)
    one_job = len({t.rank for t in traces}) == len(traces)
    found = instances(traces) if one_job else []
    if one_job and len(traces) > 1:
        a.waits = rk.rank_waits(traces, {r.rank: len(r.steps) for r in report.ranks}, found)
        a.stragglers = rk.stragglers(a.waits, {r.rank: r.step_ms for r in report.ranks})
        a.slow_groups = rk.slow_groups(traces)
        if len({t.origin_unix_ms for t in traces}) == 1:
            a.clock_offsets = align(traces, found)
    if critical and one_job and all(t.compute_known for t in traces):
        a.paths = critical_paths(traces, found)
        a.what_if = whatif.questions(a.paths)
    return a


def _size(n: int) -> str:
    return size_text(n) if n > 0 else "? B"


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
        why = "no group size" if b is not None and b.nbytes > 0 else "no message size"
        return f"bus bandwidth unknown ({why})"
    peak = f", {b.pct_of_peak:.0f}% of {b.link} peak, {b.bound}-bound" if b.pct_of_peak is not None else \
        " (peak unknown: give --hardware or --peak-gbps)"
    return f"busbw {b.busbw_gbps:.1f} GB/s{peak}"


def walk(a: Analysis) -> list[dict]:
    """The checks in order (CHECKS): [{check, verdict, evidence, try}]."""
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
                        **{"try": "profile with CPU ops recorded (ProfilerActivity.CPU)" if not a.job.gpu else
                           "profile with CPU ops and CUDA kernels recorded (ProfilerActivity.CPU, .CUDA)"}))
        return out
    saturated = idle <= IDLE_SHARE
    share, ops = _path_shares(a)
    path_step = statistics.mean(p.path_ms for p in a.paths) if a.paths else 0.0
    stall = "" if saturated else advice.host_stall(a.job, share, ops, path_step)
    out.append(dict(check="compute saturated", verdict="yes" if saturated else "no",
                    evidence=f"compute runs {100 * compute:.0f}% of the window, nothing runs {100 * idle:.0f}% "
                             f"(mean over {len(rows)} rank{'s' * (len(rows) > 1)}); {a.job.describe()}",
                    **{"try": f"find the host stall before tuning communication: {stall}" if stall else ""}))
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
    hidden_pct = _kind_overlap(a, first["kind"]) if first else None
    switch = advice.switch(first["phase"], first["kind"], first["bandwidth"].bound if first["bandwidth"] else None,
                           a.job, hidden_pct) if first else ""
    if small:
        switch = ""  # a small exposed share ends the communication search; the figures stay as evidence
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
    out.append(_critical(a))
    out.append(_what_to_change(a, out))
    return out


def _path_shares(a: Analysis) -> tuple[dict, dict]:
    """(why -> share of the steps' critical paths, host op -> ms per step on them)."""
    total = sum(p.path_ms for p in a.paths)
    share: dict[str, float] = {}
    ops: dict[str, float] = {}
    for p in a.paths:
        for s in p.segments:
            why = "waiting for rank" if s.why.startswith("waiting for rank") else s.why
            share[why] = share.get(why, 0.0) + s.ms / total if total else 0.0
            if s.kind == "host":
                ops[s.op] = ops.get(s.op, 0.0) + s.ms / len(a.paths)
    return share, ops


def _kind_overlap(a: Analysis, kind: str) -> float | None:
    rows = [k for r in a.report.ranks for k in r.by_kind if k.kind == kind and k.overlap_pct is not None]
    return statistics.mean(k.overlap_pct for k in rows) if rows else None


def _critical(a: Analysis) -> dict:
    if not a.paths:
        return dict(check="critical path", verdict="unknown", evidence="no critical path: the traces record no "
                    "computation to judge by, or are not of one job", **{"try": ""})
    share, _ = _path_shares(a)
    step = statistics.mean(p.window_ms for p in a.paths)
    main = max(share, key=share.get)
    parts = ", ".join(f"{why} {100 * v:.0f}%" for why, v in sorted(share.items(), key=lambda kv: -kv[1]) if v >= 0.005)
    ev = f"over {len(a.paths)} step{'s' * (len(a.paths) > 1)} of {step:.2f} ms: {parts}"
    if a.what_if:
        ev += "; what-if: " + "; ".join(f"{q['question']}: {q['step_ms']:.2f} ms (-{q['saving_ms']:.2f})"
                                        for q in a.what_if[:3])
    best = a.what_if[0] if a.what_if else None
    tip = ""
    if best is not None and best["saving_ms"] >= EXPOSED_SHARE * step:
        if best["question"].startswith("rank "):
            tip = advice.straggler(a.job, int(best["question"].split()[1]))
        elif best["question"].startswith("host launch"):
            tip = advice.host_stall(a.job, share, _path_shares(a)[1], step)
        else:
            kind = best["question"].split()[0]
            row = next((r for r in _top(a, 50) if r["kind"] == kind), None)
            phase = row["phase"] if row else "forward"
            bound = row["bandwidth"].bound if row and row["bandwidth"] else None
            tip = advice.switch(phase, kind, bound, a.job, _kind_overlap(a, kind))
    return dict(check="critical path", verdict=main, evidence=ev, **{"try": tip})


def _topology(a: Analysis) -> dict:
    notes, tries = [], []
    mapping = advice.topology(a.job)
    for s in a.stragglers:
        notes.append(f"rank {s['rank']} is {s['behind_ms']:.2f} ms/step behind: the others wait for it in collectives")
        tries.append(advice.straggler(a.job, s["rank"]))
    for g in a.slow_groups:
        notes.append(f"group {g['group']} moves {g['kind']} {_size(g['nbytes'])} at {g['busbw_gbps']:.1f} GB/s, its peers "
                     f"at {g['peers_median_gbps']:.1f}")
        if mapping:
            tries.append(mapping["group"].format(group=g["group"]))
    slow_links = [b for b in a.bandwidth if b.bound == "bandwidth" and b.pct_of_peak is not None
                  and b.pct_of_peak < LOW_PEAK_PCT]
    one_rank = len(a.report.ranks) < 2
    if slow_links:
        worst = min(slow_links, key=lambda b: b.pct_of_peak)
        notes.append(f"bandwidth-bound {worst.kind} {_size(worst.nbytes)} over {worst.group_size} ranks reaches "
                     f"{worst.pct_of_peak:.0f}% of {worst.link}" + (" (a lower bound: with one rank's trace the "
                     "transfer time includes waiting for the others)" if one_rank else ""))
        if mapping:
            tries.append(mapping["link"])
    if a.waits:
        notes.append("waiting inside collectives, ms/step: " + ", ".join(f"rank {r} {w:.2f}" for r, w in sorted(a.waits.items())))
    verdict = "mismatch" if a.stragglers or a.slow_groups or slow_links else ("fits" if a.waits or a.bandwidth else "unknown")
    if one_rank:
        verdict = "unknown"
        notes.append("one rank's trace: give every rank's trace (a directory) to compare ranks and groups")
    return dict(check="topology and grouping", verdict=verdict, evidence="; ".join(notes), **{"try": "; ".join(tries)})


def _what_to_change(a: Analysis, checks: list[dict]) -> dict:
    path = next((c for c in checks if c["check"] == "critical path" and c["try"]), None)
    first = path or next((c for c in checks if c["try"]), None)
    if path is not None:  # the path measured what set the step: its largest what-if comes first
        best = a.what_if[0]
        evidence = f"the critical path's largest what-if: {best['question']} saves {best['saving_ms']:.2f} ms per step"
    else:
        evidence = f"first open check: {first['check']}" if first else "every check passed"
    verdict = first["try"].split(":")[0] if first else "nothing"
    if path is not None and a.what_if[0]["question"].startswith("rank "):
        verdict = f"{' '.join(a.what_if[0]['question'].split()[:2])}: the others wait for it"
    if a.plan is not None:
        recs = getattr(a.plan, "recommendations", []) or []
        if recs:
            evidence += "; overlapkit plan on the stated configuration predicts: " + "; ".join(
                f"{r.switch} saves {r.saving_pct:.1f}% ({r.saving_s * 1e3:.1f} ms per step)" for r in recs[:3])
        else:
            evidence += "; overlapkit plan on the stated configuration finds no switch that saves time"
    return dict(check="what to change", verdict=verdict, evidence=evidence,
                **{"try": first["try"] if first else ""})
