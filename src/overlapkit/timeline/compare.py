"""Two runs side by side: what got faster or slower, by collective, phase, rank and critical path.

`compare(a, b)` takes two `Analysis` objects (timeline/diagnose.py) of the same job before and
after a change and lines up, per step (means over steps; per collective and phase also means
over ranks): the step, compute, communication and exposed communication of each rank; the
time and exposed time of each collective kind; the exposed time of each phase; and what the
critical path spent its time on. Each row: A, B, B − A, and B / A; `verdict` is "faster" when
B is lower by more than NOISE_SHARE of A, "slower" when higher by as much, else "same".
"""

from __future__ import annotations

import statistics

NOISE_SHARE = 0.02
"""Differences under this share of the first run's value are 'same'."""


def _per_step(row, value: float | None) -> float | None:
    return None if value is None else value / max(1, len(row.steps))


def _rank_figures(analysis) -> dict:
    out = {}
    for r in analysis.report.ranks:
        out[r.rank] = {"step_ms": r.step_ms, "compute_ms": _per_step(r, r.total.compute_ms),
                       "comm_ms": _per_step(r, r.total.comm_ms), "exposed_ms": _per_step(r, r.total.exposed_comm_ms)}
    return out


def _kind_figures(analysis) -> dict:
    acc: dict[str, dict[str, list]] = {}
    for r in analysis.report.ranks:
        for k in r.by_kind:
            d = acc.setdefault(k.kind, {"comm_ms": [], "exposed_ms": []})
            d["comm_ms"].append(_per_step(r, k.comm_ms))
            d["exposed_ms"].append(_per_step(r, k.exposed_ms))
    return {k: {f: statistics.mean(v) if v and None not in v else None for f, v in d.items()} for k, d in acc.items()}


def _phase_figures(analysis) -> dict:
    steps = {r.rank: max(1, len(r.steps)) for r in analysis.report.ranks}
    n = max(1, len(analysis.report.ranks))
    acc: dict[str, float] = {}
    for row in analysis.exposed_by_phase:
        acc[row["phase"]] = acc.get(row["phase"], 0.0) + row["exposed_ms"] / steps.get(row["rank"], 1) / n
    return {p: {"exposed_ms": v} for p, v in acc.items()}


def _path_figures(analysis) -> dict:
    if not analysis.paths:
        return {}
    acc: dict[str, float] = {}
    for p in analysis.paths:
        for s in p.segments:
            why = "waiting for a rank" if s.why.startswith("waiting for rank") else s.why
            acc[why] = acc.get(why, 0.0) + s.ms / len(analysis.paths)
    acc["step (critical path)"] = statistics.mean(p.path_ms for p in analysis.paths)
    return {w: {"ms": v} for w, v in acc.items()}


def _row(what: str, name, field: str, a: float | None, b: float | None) -> dict:
    delta = None if a is None or b is None else b - a
    ratio = None if a in (None, 0) or b is None else b / a
    verdict = "unknown" if delta is None else (
        "faster" if delta < -NOISE_SHARE * abs(a) and delta < 0 else
        "slower" if delta > NOISE_SHARE * abs(a) and delta > 0 else "same")
    if a is None and b is not None:
        verdict = "new"
    elif b is None and a is not None:
        verdict = "gone"
    return {"by": what, "name": name, "field": field, "a": a, "b": b, "delta": delta, "ratio": ratio,
            "verdict": verdict}


def _rows(what: str, fa: dict, fb: dict) -> list[dict]:
    rows = []
    for name in sorted(set(fa) | set(fb), key=str):
        fields = list((fa.get(name) or fb.get(name)).keys())
        for f in fields:
            rows.append(_row(what, name, f, (fa.get(name) or {}).get(f), (fb.get(name) or {}).get(f)))
    return rows


def compare(a, b) -> list[dict]:
    """Rows {by, name, field, a, b, delta, ratio, verdict}: by is 'rank', 'collective', 'phase' or 'critical path'."""
    return (_rows("critical path", _path_figures(a), _path_figures(b)) + _rows("rank", _rank_figures(a), _rank_figures(b))
            + _rows("collective", _kind_figures(a), _kind_figures(b))
            + _rows("phase", _phase_figures(a), _phase_figures(b)))


def _ms(x) -> str:
    return "—" if x is None else f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}"


def compare_tables(rows: list[dict], label_a: str = "A", label_b: str = "B") -> list[tuple]:
    """(title, header, rows) tables of the comparison, one per 'by'."""
    out = []
    for by in ("critical path", "rank", "collective", "phase"):
        sel = [r for r in rows if r["by"] == by]
        if not sel:
            continue
        body = [[str(r["name"]), r["field"], _ms(r["a"]), _ms(r["b"]), _ms(r["delta"]),
                 "—" if r["ratio"] is None else f"{r['ratio']:.2f}", r["verdict"]] for r in sel]
        out.append((f"{label_b} against {label_a}, by {by} (ms per step)",
                    [by, "field", label_a, label_b, "B − A", "B / A", "verdict"], body))
    return out
