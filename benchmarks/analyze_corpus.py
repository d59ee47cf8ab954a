"""`overlapkit analyze` on every job of the third-party trace corpus, against HolisticTraceAnalysis.

For each folder of the third-party trace corpus (`--corpus DIR`: about 50 jobs, 22 MB, kept outside the
repository; sources and licences in its SOURCES.tsv): our overlap % per rank (read + report + the
diagnosis's analysis with the cross-rank critical path and its what-ifs, timed, best of --repeat),
the critical path's length against the step's (the shortest ratio over the steps) and its untraced share, HTA 0.5.0's figure from the corpus's
hta_reference.json, the difference, and — when HTA is importable (`--hta-path` to where it is
installed) — HTA's own time for `TraceAnalysis(trace_dir=...).get_comm_comp_overlap()`.

    python benchmarks/analyze_corpus.py --corpus DIR --out benchmarks/results
    python benchmarks/analyze_corpus.py --smoke      # two small jobs kept in benchmarks/data/traces/corpus_smoke
    pip install --target /tmp/hta HolisticTraceAnalysis==0.5.0 'pandas<3'
    python benchmarks/analyze_corpus.py --corpus DIR --hta-path /tmp/hta --out benchmarks/results

Writes benchmarks/results/analyze_corpus.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from _lib.common import DATA, ROOT, add_out_arg, add_smoke_arg, out_dir, write_results
from overlapkit.timeline import TraceError, analyze, read_traces

SMOKE_CORPUS = Path(DATA) / "traces" / "corpus_smoke"
"""--smoke: a one-rank CPU trace and a two-rank gloo job of the corpus, with its reference file, analyzed once each."""


def _ours(folder: Path, repeat: int):
    files = sorted(p for p in folder.iterdir() if p.is_file())
    note, rank = "", None
    best, result = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        try:
            traces = read_traces(files, rank=rank)
        except TraceError as e:
            if "no rank" in str(e) and len(files) == 1:
                rank, note = 0, "no rank in the trace: read as rank 0 (as HTA does)"
                traces = read_traces(files, rank=0)
            else:
                return None, time.perf_counter() - t0, str(e).split(": ", 1)[-1], None
        a = analyze(traces)
        best = min(best, time.perf_counter() - t0)
        result = {r.rank: r.total.overlap_pct for r in a.report.ranks}
        path = {"steps": len(a.paths),
                "path_over_step": min((p.path_ms / p.window_ms for p in a.paths if p.window_ms > 0), default=None),
                "untraced_share": max((p.ms_by("idle") / p.path_ms for p in a.paths if p.path_ms > 0), default=None),
                "top_what_if": a.what_if[0]["question"] if a.what_if else None}
        if not all(t.compute_known for t in traces):
            note = "compute unknown: " + traces[0].notes[0]
    return result, best, note, path


def _hta(folder: Path, repeat: int):
    """HTA's overlap per rank (None where it gives NaN) and its best time over `repeat` runs."""
    from hta.trace_analysis import TraceAnalysis

    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        try:
            df = TraceAnalysis(trace_dir=str(folder)).get_comm_comp_overlap()
            out = {int(r): (None if v != v else float(v)) for r, v in zip(df["rank"], df["comp_comm_overlap_pctg"])}
        except Exception as e:  # HTA's own failures are data for the table, not ours to fix
            out = f"HTA failed: {type(e).__name__}"
        best = min(best, time.perf_counter() - t0)
    return out, best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", help="the trace corpus's folder (one folder per job, and its hta_reference.json)")
    ap.add_argument("--repeat", type=int, default=3, help="time each analysis this many times, keep the best")
    ap.add_argument("--hta-path", help="a directory holding an installed HolisticTraceAnalysis (pip --target)")
    add_out_arg(ap)
    ap.add_argument("--jobs", nargs="+", help="re-run only these jobs, replacing their rows in the existing results")
    add_smoke_arg(ap)
    args = ap.parse_args()
    if args.smoke:
        args.repeat = 1
    if args.corpus is None and not args.smoke:
        ap.error("--corpus DIR is needed: the folder of the third-party trace corpus (it is not in the repository)")
    wanted = args.jobs
    out = out_dir(args)
    corpus = Path(args.corpus or SMOKE_CORPUS)
    reference = json.loads((corpus / "hta_reference.json").read_text())["cases"]
    hta_ok = False
    if args.hta_path:
        sys.path.insert(0, args.hta_path)
        try:
            import hta  # noqa: F401

            hta_ok = True
        except ImportError as e:
            print(f"HTA not importable from {args.hta_path}: {e}", file=sys.stderr)
    rows = []
    for folder in sorted(p for p in corpus.iterdir() if p.is_dir() and (not wanted or p.name in wanted)):
        # The two alternate, best of --repeat each: a machine shared with other jobs slows one run, not both.
        seconds = hta_s = float("inf")
        for _ in range(args.repeat):
            ours, s, note, path = _ours(folder, 1)
            seconds = min(seconds, s)
            if hta_ok:
                hta_measured, s = _hta(folder, 1)
                hta_s = min(hta_s, s)
        ref = reference.get(folder.name, {})
        hta_ref = ref.get("hta_by_rank") or ({str(ref.get("rank", 0)): ref["hta"]} if "hta" in ref else {})
        row = dict(job=folder.name, ours=ours, ours_s=seconds, hta_reference=hta_ref, note=note, critical_path=path)
        if hta_ok:
            row["hta_measured"], row["hta_s"] = hta_measured, hta_s
        rows.append(row)
        print(f"{folder.name}: {ours} in {seconds:.2f} s {note}", file=sys.stderr, flush=True)
    if args.jobs:
        previous = json.loads(Path(out, "analyze_corpus.json").read_text())["rows"]
        fresh = {r["job"]: r for r in rows}
        rows = [fresh.get(r["job"], r) for r in previous]
    shown = os.path.relpath(corpus.resolve(), ROOT) if corpus.resolve().is_relative_to(ROOT) else str(corpus)
    write_results(dict(corpus=shown, hta_timed=hta_ok, rows=rows), os.path.join(out, "analyze_corpus"), _markdown)


def _fmt(x) -> str:
    return "—" if x is None else f"{x:.2f}"


def _markdown(result: dict) -> str:
    lines = ["| job | rank | HTA 0.5.0 % | overlapkit % | diff | overlapkit s | HTA s | critical path / step (min) | "
             "untraced share (max) | note |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    if result["hta_timed"]:
        slower = [r["job"] for r in result["rows"] if "hta_s" in r and r["ours_s"] > r["hta_s"]]
        lines.insert(0, f"overlapkit slower than HTA on: {', '.join(slower) or 'no trace'} (best of each; the same "
                        f"machine, one after the other)\n")
    for r in result["rows"]:
        ours = r["ours"] or {}
        ranks = sorted(set(map(int, ours)) | set(map(int, r["hta_reference"]))) or ["—"]
        for i, rank in enumerate(ranks):
            o = ours.get(rank) if isinstance(rank, int) else None
            h = r["hta_reference"].get(str(rank))
            diff = o - h if o is not None and h is not None else None
            hta_s = f"{r['hta_s']:.2f}" if "hta_s" in r and i == 0 else ""
            cp = r.get("critical_path") or {}
            cov = "" if i or cp.get("path_over_step") is None else f"{cp['path_over_step']:.4f}"
            idle = "" if i or cp.get("untraced_share") is None else f"{cp['untraced_share']:.3f}"
            lines.append(f"| {r['job'] if i == 0 else ''} | {rank} | {_fmt(h)} | {_fmt(o)} | {_fmt(diff)} | "
                         f"{r['ours_s']:.2f} | {hta_s} | {cov} | {idle} | {r['note'] if i == 0 else ''} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
