"""`overlapkit analyze TRACE|DIR...`: how much communication compute hid, why, and what the step waited on.

Reads PyTorch profiler traces (files, or directories of them as `tensorboard_trace_handler`
writes), prints the overlap report (or `--json`), the cross-rank critical path and its
what-ifs, walks the diagnosis (`--diagnose`), draws the timeline (`--plot`), writes one
self-contained page (`--html`), and lines up two runs (`--compare A B`). Bad input ends with one
line naming the file and the problem, and exit code 2: unreadable traces, corrupt times, the
same rank twice, traces of different jobs, an unsupported picture format.

The cost model is not imported here: the tools layer (`overlapkit/analyze_tool.py`) passes in
what `--hardware`, `--config` and `--what-if overlap=...` need (`register(..., tools=...)`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .bandwidth import check_peak
from .trace import TraceError, label, read_traces, trace_files

PLOT_FORMATS = ("png", "pdf", "svg", "svgz", "jpg", "jpeg", "eps", "ps", "tif", "tiff", "webp", "pgf")
"""Picture formats matplotlib writes."""


class Tools:
    """What the cost model lends `analyze`; each is None when analyze runs without it."""

    links = None
    """(gpu name, --hardware) -> bandwidth.Links or None; raises ValueError on a bad preset."""
    plan = None
    """(--config pairs, hardware preset) -> the cost model's StepReport; raises ValueError."""
    what_if = None
    """(--config pairs, hardware preset, change 'overlap=MODE', paths) -> what-if row; raises ValueError."""


def register(subparsers, tools: Tools | None = None) -> argparse.ArgumentParser:
    """Add the `analyze` subcommand to an argparse subparsers object."""
    p = subparsers.add_parser(
        "analyze", help="measure hidden and exposed communication in PyTorch profiler traces, and diagnose it",
        description="Read PyTorch profiler (Kineto) traces, one per rank (files or directories), and report "
                    "communication time, exposed communication and overlap per rank, step, kind and stream, the "
                    "cross-rank critical path and what-ifs on it.")
    p.add_argument("traces", nargs="*", metavar="TRACE", help="a .json or .json.gz profiler trace, or a directory of them")
    p.add_argument("--json", action="store_true",
                   help="print the report (with critical_path, what_if, diagnosis, stragglers) as one JSON object")
    p.add_argument("--diagnose", action="store_true", help="walk the diagnosis: verdict, evidence, what to try")
    p.add_argument("--plot", metavar="PNG", help="draw the timeline picture (with the critical path) to this file")
    p.add_argument("--html", metavar="HTML", help="write one self-contained report page to this file")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"),
                   help="two runs (directories or files) side by side: what got faster or slower")
    p.add_argument("--what-if", nargs="+", metavar="Q", dest="what_if",
                   help="questions on the critical path: hide=KIND, rank=K, launch-gaps; with --config also "
                        "overlap=MODE or overlap.ENGINE=MODE (the cost model's prediction)")
    p.add_argument("--rank", type=int, help="the rank of a single trace that has no distributedInfo")
    p.add_argument("--last-step", action="store_true",
                   help="keep the last ProfilerStep (dropped by default: a profiler usually stops inside it)")
    p.add_argument("--brief", action="store_true", help="only the per-rank and per-step tables (with --diagnose: only the diagnosis)")
    p.add_argument("--hardware", help="cost-model hardware preset for link peaks (default: from the trace's GPU name)")
    p.add_argument("--peak-gbps", type=float, help="the link's peak bandwidth per GPU, GB/s (overrides the preset's)")
    p.add_argument("--config", nargs="+", metavar="KEY=VALUE",
                   help="the job's configuration for `overlapkit plan`'s predicted savings, e.g. model=llama3-8b "
                        "hardware=h200-sxm tp=2 dp=4 overlap=none")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar while reading (default: on a terminal, for 32 MB of traces or more)")
    p.set_defaults(func=run, tools=tools or Tools())
    return p


def _fail(problem: str) -> int:
    print(f"overlapkit analyze: error: {problem}", file=sys.stderr)
    return 2


def check_one_job(traces) -> None:
    """Refuse the same rank twice and traces of different jobs (world sizes or job ids differ, or
    they never overlap in time: the ranks of one job are profiled over the same steps)."""
    seen: dict[int, str] = {}
    for t in traces:
        if t.rank in seen:
            raise TraceError(f"rank {t.rank} appears twice ({seen[t.rank]} and {t.path}): the same trace given twice, "
                             f"two profiling cycles of one rank (give one cycle's files), or different jobs")
        seen[t.rank] = t.path
    for what, values in (("world sizes", {t.world_size for t in traces if t.world_size is not None}),
                         ("job ids", {t.job_id for t in traces if t.job_id is not None})):
        if len(values) > 1:
            raise TraceError(f"traces of different jobs: {what} {sorted(map(str, values))} differ; analyze each job "
                             f"on its own")
    if len({t.origin_unix_ms for t in traces}) > 1:  # read_traces puts traces that overlap in time on one axis
        first, other = traces[0], next(t for t in traces if t.origin_unix_ms != traces[0].origin_unix_ms)
        raise TraceError(f"traces of different jobs: {first.path} and {other.path} never overlap in time "
                         f"({abs(other.origin_unix_ms - first.origin_unix_ms) / 1e3:.0f} s apart); analyze each job "
                         f"on its own")


def _read(args, paths):
    from .progress import Progress

    with Progress(trace_files(paths), show=args.progress) as bar:
        traces = read_traces(paths, rank=args.rank, last_step=args.last_step, progress=bar)
    check_one_job(traces)
    bar.note(f"analyzing {sum(len(t.spans) for t in traces)} spans of {len(traces)} rank(s): the report, "
             f"the critical path and the diagnosis")
    return traces


def _analysis(args, traces):
    from .diagnose import analyze

    tools = args.tools
    gpu = next((t.gpu_name for t in traces if t.gpu_name), None)
    if args.hardware and tools.links is None:
        raise ValueError("--hardware needs the cost model's presets: run it as `overlapkit analyze`")
    links = tools.links(gpu, args.hardware) if tools.links is not None else None
    analysis = analyze(traces, links=links, peak_gbps=args.peak_gbps)
    if args.config:
        if tools.plan is None:
            raise ValueError("--config needs the cost model: run it as `overlapkit analyze`")
        analysis.plan = tools.plan(args.config, args.hardware or analysis.hardware)
    return analysis


def _what_ifs(args, analysis, traces) -> list[dict]:
    from . import whatif

    ranks = {t.rank for t in traces}
    kinds = {s.kind for t in traces for s in t.spans if s.is_comm}
    out = []
    for q in args.what_if or ():
        if q.startswith("overlap"):
            if not args.config or args.tools.what_if is None:
                raise ValueError(f"--what-if {q}: a cost-model question needs --config (the job's configuration)")
            out.append(args.tools.what_if(args.config, args.hardware or analysis.hardware, q, analysis.paths))
        else:
            out.append(whatif.answer(analysis.paths, q, ranks=ranks, kinds=kinds))
    return out


def run(args) -> int:
    from .diagnose import walk
    from .fsdp2 import layer_table
    from .serving import serving_table
    from .table import path_tables, print_diagnosis, print_report, print_tables

    for out, flag in ((args.plot, "--plot"),):
        if out and os.path.splitext(out)[1].lstrip(".").lower() not in PLOT_FORMATS:
            return _fail(f"{out}: cannot draw to this format; use one of {', '.join(PLOT_FORMATS)}")
    for out in (args.html, args.plot):
        if out and not os.path.isdir(os.path.dirname(os.path.abspath(out))):
            return _fail(f"{out}: the folder {os.path.dirname(os.path.abspath(out))} does not exist")
    try:
        check_peak(args.peak_gbps)  # before reading: a bad flag should not cost a large trace's read
    except ValueError as e:
        return _fail(str(e))
    if args.compare:
        if args.traces:
            return _fail("--compare A B takes the two runs; give no other traces")
        return _compare(args)
    if not args.traces:
        return _fail("give the traces to analyze (files or directories), or --compare A B")
    try:
        traces = _read(args, args.traces)
        analysis = _analysis(args, traces)
        asked = _what_ifs(args, analysis, traces)
    except (TraceError, ValueError) as e:
        return _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    diagnosis = walk(analysis)
    if args.json:
        doc = to_json(analysis, traces, diagnosis)
        doc["what_if_asked"] = asked
        print(json.dumps(doc, indent=2))
    else:
        console = _console()
        if not args.diagnose or not args.brief:
            print_report(analysis.report, console=console, detail=not args.brief)
        if not args.brief:
            print_tables(layer_table(traces), console=console)
            print_tables(serving_table(traces), console=console)
            print_tables(path_tables(analysis), console=console)
        if asked:
            print_tables([("What-if, asked", ["if", "step ms", "saves ms", "measured ms"],
                           [[q["question"], f"{q['step_ms']:.3f}", f"{q['saving_ms']:.3f}", f"{q['measured_ms']:.3f}"]
                            for q in asked])], console=console)
        if args.diagnose:
            print_diagnosis(analysis, diagnosis, console=console)
        for t in traces:
            if t.dropped_step is not None:
                print(f"{os.path.basename(t.path)}: ProfilerStep#{t.dropped_step} left out "
                      f"(the last step; --last-step keeps it)", file=sys.stderr)
            for note in t.notes:
                print(f"{os.path.basename(t.path)}: {note}", file=sys.stderr)
    title = "Timeline of " + ", ".join(os.path.basename(os.path.normpath(p)) for p in args.traces)
    try:
        if args.plot:
            from .plot import plot_groups

            plot_groups(plot_labels(traces), args.plot, title=title, critical=analysis.paths)
            print(f"timeline written to {args.plot}", file=sys.stderr)
        if args.html:
            from .fsdp2 import layer_table as layers
            from .html import write_html

            write_html(args.html, analysis, diagnosis, plot_labels(traces), title, extra_tables=layers(traces))
            print(f"report written to {args.html}", file=sys.stderr)
    except OSError as e:
        return _fail(f"{args.html or args.plot}: cannot write: {e.strerror or e}")
    return 0


def _console():
    try:
        from rich.console import Console
    except ImportError:
        return None
    return Console() if sys.stdout.isatty() else Console(width=150)


def _compare(args) -> int:
    from .compare import compare, compare_tables
    from .table import print_tables

    runs = []
    try:
        for p in args.compare:
            traces = _read(args, [p])
            runs.append(_analysis(args, traces))
    except (TraceError, ValueError) as e:
        return _fail(str(e).splitlines()[0])
    rows = compare(*runs)
    a, b = (os.path.basename(os.path.normpath(p)) for p in args.compare)
    if args.json:
        print(json.dumps({"a": args.compare[0], "b": args.compare[1], "compare": rows}, indent=2))
    else:
        print_tables(compare_tables(rows, a, b), console=_console())
    return 0


def plot_labels(traces) -> dict:
    """One picture group per trace, under a label no other trace has (a repeated one gets its directory, then #i)."""
    groups: dict[str, list] = {}
    for i, t in enumerate(traces):
        name = f"rank {t.rank} ({label(t.path)})"
        if name in groups:
            name = f"rank {t.rank} ({os.path.basename(os.path.dirname(t.path))}/{label(t.path)})"
        while name in groups:
            name += f" #{i}"
        groups[name] = t.spans
    return groups


def to_json(analysis, traces, diagnosis) -> dict:
    """The --json object: the report, the per-trace facts, and the analysis the diagnosis read."""
    from dataclasses import asdict

    from .fsdp2 import layer_json
    from .serving import serving_json

    doc = analysis.report.to_dict()
    for row, t in zip(doc["ranks"], traces):
        row.update(world_size=t.world_size, dropped_step=t.dropped_step, device=t.device)
        row["wait_ms"] = analysis.waits.get(t.rank)
    doc["hardware"] = analysis.hardware
    doc["job"] = {"device": analysis.job.device, "frameworks": list(analysis.job.frameworks),
                  "evidence": analysis.job.evidence} if analysis.job else None
    doc["clock_offsets_ms"] = {str(r): v for r, v in analysis.clock_offsets.items()}
    doc["critical_path"] = [dict(step=p.step, **{k: v for k, v in s.to_dict().items()})
                            for p in analysis.paths for s in p.segments]
    doc["critical_paths"] = [{"step": p.step, "window_ms": p.window_ms, "path_ms": p.path_ms,
                              "crossings": [asdict(c) for c in p.crossings]} for p in analysis.paths]
    doc["what_if"] = analysis.what_if
    doc["bandwidth"] = [asdict(b) for b in analysis.bandwidth]
    doc["exposed_by_phase"] = analysis.exposed_by_phase
    doc["stragglers"] = analysis.stragglers
    doc["slow_groups"] = analysis.slow_groups
    doc["diagnosis"] = diagnosis
    doc["zero3_layers"] = layer_json(traces)
    doc["serving_steps"] = serving_json(traces)
    return doc


def main(argv: list[str] | None = None, tools: Tools | None = None) -> int:
    """Run `analyze` on its own (the package CLI wires `register` into `overlapkit`, with the cost model)."""
    parser = argparse.ArgumentParser(prog="overlapkit")
    register(parser.add_subparsers(dest="command", required=True), tools)
    args = parser.parse_args(["analyze"] + list(sys.argv[1:] if argv is None else argv))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
