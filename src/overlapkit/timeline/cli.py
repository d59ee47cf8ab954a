"""`overlapkit analyze TRACE...`: how much communication compute hid in profiler traces.

Reads PyTorch profiler traces, prints the overlap report (or `--json`), draws the timeline
(`--plot`). Bad input ends with one line naming the file and the problem, and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .trace import TraceError, read_traces


def register(subparsers) -> argparse.ArgumentParser:
    """Add the `analyze` subcommand to an argparse subparsers object."""
    p = subparsers.add_parser(
        "analyze", help="measure hidden and exposed communication in PyTorch profiler traces",
        description="Read PyTorch profiler (Kineto) traces, one per rank, and report communication time, "
                    "exposed communication and overlap per rank, step, kind and stream.")
    p.add_argument("traces", nargs="+", metavar="TRACE", help="a .json or .json.gz profiler trace")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--plot", metavar="PNG", help="draw the timeline picture to this file")
    p.add_argument("--rank", type=int, help="the rank of a single trace that has no distributedInfo")
    p.add_argument("--last-step", action="store_true",
                   help="keep the last ProfilerStep (dropped by default: a profiler usually stops inside it)")
    p.add_argument("--brief", action="store_true", help="only the per-rank and per-step tables")
    p.set_defaults(func=run)
    return p


def _fail(problem: str) -> int:
    print(f"overlapkit analyze: error: {problem}", file=sys.stderr)
    return 2


def run(args) -> int:
    from .report import report_traces
    from .table import print_report

    try:
        traces = read_traces(args.traces, rank=args.rank, last_step=args.last_step)
    except TraceError as e:
        return _fail(str(e))
    report = report_traces(traces)
    if args.json:
        doc = report.to_dict()
        for row, t in zip(doc["ranks"], traces):
            row.update(world_size=t.world_size, dropped_step=t.dropped_step, device=t.device)
        print(json.dumps(doc, indent=2))
    else:
        console = None
        try:
            from rich.console import Console

            console = Console() if sys.stdout.isatty() else Console(width=150)
        except ImportError:
            pass
        print_report(report, console=console, detail=not args.brief)
        for t in traces:
            if t.dropped_step is not None:
                print(f"{os.path.basename(t.path)}: ProfilerStep#{t.dropped_step} left out "
                      f"(the last step; --last-step keeps it)", file=sys.stderr)
    if args.plot:
        from .plot import plot_groups

        groups = {f"rank {t.rank} ({os.path.basename(t.path).split('.')[0]})": t.spans for t in traces}
        try:
            plot_groups(groups, args.plot, title="Timeline of " + ", ".join(os.path.basename(p) for p in args.traces))
        except OSError as e:
            return _fail(f"{args.plot}: cannot write the picture: {e.strerror or e}")
        print(f"timeline written to {args.plot}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run `analyze` on its own (the package CLI wires `register` into `overlapkit`)."""
    parser = argparse.ArgumentParser(prog="overlapkit")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["analyze"] + list(sys.argv[1:] if argv is None else argv))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
