"""Print an overlap report as tables: how much communication compute hid, per rank, step, kind, stream.

Uses rich when it is installed and plain aligned text when it is not (GPU machines often
lack it), from the same rows.
"""

from __future__ import annotations

import os

from .messages import size_text
from .report import Report, Times

FOLD_IDLE_SHARE = 0.01
"""In the path table, untraced gaps shorter than this share of the path are shown inside the run around them."""
_TIME_HEAD = ["step ms", "compute ms", "comm ms", "exposed ms", "overlap %", "idle ms", "T_last ms"]


def _ms(x: float | None) -> str:
    if x is None:
        return "unknown"
    return f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}"


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}"



def _times(t: Times, step_ms: float) -> list[str]:
    return [_ms(step_ms), _ms(t.compute_ms), _ms(t.comm_ms), _ms(t.exposed_comm_ms),
            _pct(t.overlap_pct), _ms(t.idle_ms), _ms(t.t_last_ms)]


def tables(report: Report, detail: bool = True) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of every table of the report."""
    ranks = [[str(r.rank), str(len(r.steps) or "—")] + _times(r.total, r.step_ms) + [os.path.basename(r.source)]
             for r in report.ranks]
    out = [("Communication hidden behind compute, per rank (totals over the window; step ms is the mean step)",
            ["rank", "steps"] + _TIME_HEAD + ["source"], ranks)]
    steps = [[str(r.rank), str(n)] + _times(t, t.step_ms) for r in report.ranks for n, t in r.steps]
    if steps:
        out.append(("Per step", ["rank", "step"] + _TIME_HEAD, steps))
    if not detail:
        return out
    kinds = [[str(r.rank), k.kind, str(k.count), size_text(k.nbytes), _ms(k.comm_ms), _ms(k.exposed_ms),
              _pct(k.overlap_pct)] for r in report.ranks for k in r.by_kind]
    if kinds:
        out.append(("Communication by kind", ["rank", "kind", "count", "bytes", "comm ms", "exposed ms",
                                              "overlap %"], kinds))
    sizes = [[str(r.rank), k.kind, size_text(k.nbytes), str(k.count), _ms(k.comm_ms), _ms(k.exposed_ms),
              _ms(k.comm_ms / k.count)] for r in report.ranks for k in r.by_size]
    if sizes:
        out.append(("Communication by kind and message size",
                    ["rank", "kind", "message", "count", "comm ms", "exposed ms", "mean ms"], sizes))
    streams = [[str(r.rank), s.stream, str(s.count), _ms(s.busy_ms), _ms(s.compute_ms), _ms(s.comm_ms),
                _ms(s.exposed_ms)] for r in report.ranks for s in r.by_stream]
    out.append(("By stream", ["rank", "stream", "spans", "busy ms", "compute ms", "comm ms", "exposed ms"],
                streams))
    return out


def summary(report: Report) -> str:
    """One line naming the slowest rank, or '' when there is none to name."""
    slow = report.slowest
    if slow is None:
        return ""
    return (f"slowest rank: {slow.rank} ({_ms(slow.step_ms)} ms per step, "
            f"{_ms(slow.total.exposed_comm_ms)} ms exposed communication)")


def print_report(report: Report, console=None, detail: bool = True) -> None:
    """Print the report's tables to a rich Console (made if None), or as plain text without rich."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(plain_text(report, detail))
        return
    console = console or Console()
    for title, head, rows in tables(report, detail):
        t = Table(title=title, title_justify="left")
        for i, h in enumerate(head):
            t.add_column(h, justify="left" if i < 2 or h in ("kind", "stream", "source") else "right")
        for row in rows:
            t.add_row(*row)
        console.print(t)
    if line := summary(report):
        console.print(line)


def plain_text(report: Report, detail: bool = True) -> str:
    """The same tables as aligned plain text."""
    parts = []
    for title, head, rows in tables(report, detail):
        widths = [max(len(x) for x in col) for col in zip(head, *rows)]
        parts.append(title)
        parts += ["  ".join(x.rjust(w) for x, w in zip(row, widths)) for row in [head] + rows]
        parts.append("")
    if line := summary(report):
        parts.append(line)
    return "\n".join(parts)


def print_tables(tables: list[tuple[str, list[str], list[list[str]]]], console=None, left: int = 2) -> None:
    """Print (title, header, rows) tables to a rich Console (made if None), or as plain text without
    rich; the first `left` columns align left."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        for title, head, rows in tables:
            widths = [max(len(x) for x in col) for col in zip(head, *rows)]
            print(title)
            print("\n".join("  ".join(x.rjust(w) for x, w in zip(row, widths)) for row in [head] + rows) + "\n")
        return
    console = console or Console()
    for title, head, rows in tables:
        t = Table(title=title, title_justify="left")
        for i, h in enumerate(head):
            t.add_column(h, justify="left" if i < left else "right")
        for row in rows:
            t.add_row(*row)
        console.print(t)


def _gbps(x: float | None) -> str:
    return "?" if x is None else f"{x:.2f}" if x < 10 else f"{x:.1f}"


def diagnosis_tables(analysis, top: int = 12) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of the bandwidth, exposed-by-phase and per-rank wait tables."""
    out = []
    bw = sorted(analysis.bandwidth, key=lambda b: -(b.median_ms * b.count))[:top]
    if bw:
        out.append(("Collectives: bandwidth (nccl-tests algbw/busbw) against the link's peak, most time first",
                    ["rank", "kind", "message", "ranks", "count", "median ms", "algbw GB/s", "busbw GB/s", "% of peak",
                     "bound"],
                    [[str(b.rank), b.kind, size_text(b.nbytes), str(b.group_size or "?"), str(b.count), _ms(b.median_ms),
                      _gbps(b.algbw_gbps), _gbps(b.busbw_gbps), _pct(b.pct_of_peak), b.bound or "?"] for b in bw]))
    ex = [r for r in analysis.exposed_by_phase if r["exposed_ms"] > 0]
    if ex:
        out.append(("Top exposed collectives by phase", ["rank", "phase", "kind", "message", "count", "comm ms",
                                                         "exposed ms"],
                    [[str(r["rank"]), r["phase"], r["kind"], size_text(r["nbytes"]), str(r["count"]), _ms(r["comm_ms"]),
                      _ms(r["exposed_ms"])] for r in ex]))
    if analysis.waits:
        behind = {s["rank"]: s["behind_ms"] for s in analysis.stragglers}
        out.append(("Across ranks: step time, time waiting inside collectives (per step), stragglers",
                    ["rank", "step ms", "wait ms", "straggler: behind ms"],
                    [[str(r.rank), _ms(r.step_ms), _ms(analysis.waits.get(r.rank, 0.0)),
                      _ms(behind[r.rank]) if r.rank in behind else ""] for r in analysis.report.ranks]))
    return out


def representative(paths):
    """The step whose critical path has the median length (the path tables show it)."""
    if not paths:
        return None
    return sorted(paths, key=lambda p: p.path_ms)[(len(paths) - 1) // 2]


def path_rows(path, max_rows: int = 40) -> list[list[str]]:
    """The path as rows (rank, op, ms, why, start ms), runs of one rank and why merged into one row
    named by their longest op; at most `max_rows` rows (the shortest runs folded into the last)."""
    runs: list[list] = []
    small = FOLD_IDLE_SHARE * path.path_ms
    for s in path.segments:
        if runs and runs[-1][0] == s.rank and s.why == "idle" and s.ms < small:
            runs[-1][2].append(s)  # a short untraced gap inside a run (Python between ops): shown with it
        elif runs and runs[-1][0] == s.rank and runs[-1][1] == s.why:
            runs[-1][2].append(s)
        else:
            runs.append([s.rank, s.why, [s]])
    rows = []
    for rank, why, segs in runs:
        longest = max((x for x in segs if x.why == why), key=lambda x: x.ms)
        ops = {x.op for x in segs if x.why == why}
        gaps = sum(x.ms for x in segs if x.why != why)
        op = longest.op + (f" (+{len(ops) - 1} other ops)" if len(ops) > 1 else "") + \
            (f" (+{gaps:.3f} ms untraced gaps between)" if gaps > 0 else "")
        rows.append([str(rank), op, sum(x.ms for x in segs if x.why == why), why, segs[0].start_ms])
    if len(rows) > max_rows:
        keep = sorted(sorted(range(len(rows)), key=lambda i: -rows[i][2])[:max_rows - 1])
        rest = sum(rows[i][2] for i in range(len(rows)) if i not in set(keep))
        rows = [rows[i] for i in keep] + [["", f"{len(runs) - len(keep)} shorter runs", rest, "(folded)", 0.0]]
    return [[r[0], r[1], _ms(r[2]), r[3], _ms(r[4]) if r[3] != "(folded)" else ""] for r in rows]


def path_tables(analysis) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of the critical path of the median step, the breakdown per step, and the what-ifs."""
    p = representative(analysis.paths)
    if p is None:
        return []
    out = [(f"Critical path of step {p.step if p.step is not None else '(whole trace)'}: {_ms(p.path_ms)} ms of a "
            f"{_ms(p.window_ms)} ms step across ranks (--json has every step)",
            ["rank", "op", "ms", "why", "at ms"], path_rows(p))]
    whys = ["compute", "exposed comm", "waiting for rank", "host launch gap", "copy", "idle"]
    body = [[str(q.step), _ms(q.window_ms), _ms(q.path_ms)] + [_ms(q.ms_by(w)) for w in whys] for q in analysis.paths]
    out.append(("Critical path per step: ms on the path by why", ["step", "step ms", "path ms"] + whys, body))
    if analysis.what_if:
        out.append(("What-if, on the critical path (first order: another path may become critical)",
                    ["if", "step ms", "saves ms", "measured ms"],
                    [[q["question"], _ms(q["step_ms"]), _ms(q["saving_ms"]), _ms(q["measured_ms"])]
                     for q in analysis.what_if]))
    return out


def diagnosis_text(diagnosis: list[dict]) -> str:
    """The diagnosis walk as numbered plain-text lines."""
    lines = ["Diagnosis"]
    for i, d in enumerate(diagnosis, 1):
        lines.append(f"{i}. {d['check']}: {d['verdict']}")
        if d["evidence"]:
            lines.append(f"   evidence: {d['evidence']}")
        if d["try"]:
            lines.append(f"   try: {d['try']}")
    return "\n".join(lines)


def print_diagnosis(analysis, diagnosis: list[dict], console=None) -> None:
    """Print the diagnosis tables (rich when installed) and the walk."""
    try:
        from rich.console import Console
    except ImportError:
        print_tables(diagnosis_tables(analysis), left=3)
        print(diagnosis_text(diagnosis))
        return
    console = console or Console()
    print_tables(diagnosis_tables(analysis), console, left=3)
    console.print(diagnosis_text(diagnosis), markup=False, highlight=False, soft_wrap=True)
