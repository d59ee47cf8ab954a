"""`overlapkit analyze TRACE|DIR...`: how much communication compute hid, and (`--diagnose`) why.

Reads PyTorch profiler traces (files, or directories of them as `tensorboard_trace_handler`
writes), prints the overlap report (or `--json`), walks seed 004 §15's diagnosis
(`--diagnose`), draws the timeline (`--plot`). Bad input ends with one line naming the file and
the problem, and exit code 2: unreadable traces, the same rank twice, traces of different jobs,
an unsupported picture format.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .trace import TraceError, label, read_traces

PLOT_FORMATS = ("png", "pdf", "svg", "svgz", "jpg", "jpeg", "eps", "ps", "tif", "tiff", "webp", "pgf")
"""Picture formats matplotlib writes."""
CONFIG_INTS = ("tp", "pp", "vpp", "dp", "ep", "cp", "micro_batch", "global_batch", "zero")


def register(subparsers) -> argparse.ArgumentParser:
    """Add the `analyze` subcommand to an argparse subparsers object."""
    p = subparsers.add_parser(
        "analyze", help="measure hidden and exposed communication in PyTorch profiler traces, and diagnose it",
        description="Read PyTorch profiler (Kineto) traces, one per rank (files or directories), and report "
                    "communication time, exposed communication and overlap per rank, step, kind and stream.")
    p.add_argument("traces", nargs="+", metavar="TRACE", help="a .json or .json.gz profiler trace, or a directory of them")
    p.add_argument("--json", action="store_true", help="print the report (with diagnosis and stragglers) as one JSON object")
    p.add_argument("--diagnose", action="store_true", help="walk seed 004's diagnosis order: verdict, evidence, what to try")
    p.add_argument("--plot", metavar="PNG", help="draw the timeline picture to this file")
    p.add_argument("--rank", type=int, help="the rank of a single trace that has no distributedInfo")
    p.add_argument("--last-step", action="store_true",
                   help="keep the last ProfilerStep (dropped by default: a profiler usually stops inside it)")
    p.add_argument("--brief", action="store_true", help="only the per-rank and per-step tables (with --diagnose: only the diagnosis)")
    p.add_argument("--hardware", help="cost-model hardware preset for link peaks (default: from the trace's GPU name)")
    p.add_argument("--peak-gbps", type=float, help="the link's peak bandwidth per GPU, GB/s (overrides the preset's)")
    p.add_argument("--config", nargs="+", metavar="KEY=VALUE",
                   help="the job's configuration for `overlapkit plan`'s predicted savings, e.g. model=llama3-8b "
                        "hardware=h200-sxm tp=2 dp=4 overlap=none")
    p.set_defaults(func=run)
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


def plan_from_config(pairs: list[str], hardware: str | None):
    """The cost model's prediction (with recommendations) for `KEY=VALUE` pairs; ConfigError on bad ones."""
    from overlapkit.costmodel import ConfigError, Overlap, ParallelConfig, plan

    cfg = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ConfigError(f"config={pair!r}: expected KEY=VALUE")
        cfg[key.replace("-", "_")] = value
    if "model" not in cfg:
        raise ConfigError("config: model=NAME is required (a preset, or a model JSON file)")
    model, hw = cfg.pop("model"), cfg.pop("hardware", hardware or "h200-sxm")
    kwargs = {}
    for key, value in cfg.items():
        if key in CONFIG_INTS:
            try:
                kwargs[key] = int(value)
            except ValueError:
                raise ConfigError(f"config {key}={value!r}: expected an integer") from None
        elif key == "overlap":
            kwargs["overlap"] = Overlap.all(value)
        elif key == "sp":
            kwargs["sp"] = value.lower() in ("1", "true", "yes")
        else:
            raise ConfigError(f"config {key}={value!r}: unknown key; known: model, hardware, overlap, sp, "
                              + ", ".join(CONFIG_INTS))
    return plan(model, hw, ParallelConfig(**kwargs))


def run(args) -> int:
    from .diagnose import analyze, walk
    from .fsdp2 import layer_table
    from .table import print_diagnosis, print_report, print_tables

    if args.plot and os.path.splitext(args.plot)[1].lstrip(".").lower() not in PLOT_FORMATS:
        return _fail(f"{args.plot}: cannot draw to this format; use one of {', '.join(PLOT_FORMATS)}")
    try:
        traces = read_traces(args.traces, rank=args.rank, last_step=args.last_step)
        check_one_job(traces)
    except TraceError as e:
        return _fail(str(e))
    predicted = None
    try:
        from overlapkit.costmodel import ConfigError

        analysis = analyze(traces, hardware=args.hardware, peak_gbps=args.peak_gbps)
        if args.config:
            predicted = plan_from_config(args.config, args.hardware or analysis.hardware)
    except ConfigError as e:
        return _fail(str(e))
    analysis.plan = predicted
    diagnosis = walk(analysis)
    report = analysis.report
    if args.json:
        print(json.dumps(to_json(analysis, traces, diagnosis), indent=2))
    else:
        console = None
        try:
            from rich.console import Console

            console = Console() if sys.stdout.isatty() else Console(width=150)
        except ImportError:
            pass
        if not args.diagnose or not args.brief:
            print_report(report, console=console, detail=not args.brief)
        if not args.brief:
            print_tables(layer_table(traces), console=console)
        if args.diagnose:
            print_diagnosis(analysis, diagnosis, console=console)
        for t in traces:
            if t.dropped_step is not None:
                print(f"{os.path.basename(t.path)}: ProfilerStep#{t.dropped_step} left out "
                      f"(the last step; --last-step keeps it)", file=sys.stderr)
            for note in t.notes:
                print(f"{os.path.basename(t.path)}: {note}", file=sys.stderr)
    if args.plot:
        from .plot import plot_groups

        try:
            plot_groups(plot_labels(traces), args.plot,
                        title="Timeline of " + ", ".join(os.path.basename(p) for p in args.traces))
        except OSError as e:
            return _fail(f"{args.plot}: cannot write the picture: {e.strerror or e}")
        print(f"timeline written to {args.plot}", file=sys.stderr)
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

    doc = analysis.report.to_dict()
    for row, t in zip(doc["ranks"], traces):
        row.update(world_size=t.world_size, dropped_step=t.dropped_step, device=t.device)
        row["wait_ms"] = analysis.waits.get(t.rank)
    doc["hardware"] = analysis.hardware
    doc["bandwidth"] = [asdict(b) for b in analysis.bandwidth]
    doc["exposed_by_phase"] = analysis.exposed_by_phase
    doc["stragglers"] = analysis.stragglers
    doc["slow_groups"] = analysis.slow_groups
    doc["diagnosis"] = diagnosis
    doc["zero3_layers"] = layer_json(traces)
    return doc


def main(argv: list[str] | None = None) -> int:
    """Run `analyze` on its own (the package CLI wires `register` into `overlapkit`)."""
    parser = argparse.ArgumentParser(prog="overlapkit")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["analyze"] + list(sys.argv[1:] if argv is None else argv))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
