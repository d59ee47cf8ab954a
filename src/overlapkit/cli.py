"""The `overlapkit` command: demo | analyze | plan | bench | doctor."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile

from . import __version__
from .vocabulary import OVERLAP_MODES

# Subcommands live with their concern (analyze_tool.py: analyze, joining the trace analyzer and the
# cost model; costmodel/cli.py: plan, bench); each module exposes register(subparsers).


def _demo(args) -> int:
    from .demos import DemoConfig, check_world, run
    try:
        cfg = DemoConfig(tp=args.tp, dp=args.dp, steps=args.steps, overlap=args.overlap,
                         device=args.device, seed=args.seed, trace_dir=args.trace, timeout_s=args.timeout, ep=args.ep,
                         cp=args.cp, pp=args.pp, zero=args.zero, schedule=args.schedule)
        # Everything that can be refused is refused here, before any rank starts.
        check_world(cfg, oversubscribe=args.oversubscribe)
        plot = None if args.plot == "" else check_output_path(args.plot, "--plot")
        if args.trace is not None:
            check_output_dir(args.trace, "--trace")
    except ValueError as e:
        print(f"overlapkit demo: {e}", file=sys.stderr)
        return 2
    from .launch import RankFailed
    try:
        return run(cfg, plot_path=plot, oversubscribe=args.oversubscribe)
    except RankFailed as e:
        # One line naming the rank; its traceback only when asked for.
        print(f"overlapkit demo: {e.summary}", file=sys.stderr)
        if os.environ.get("OVERLAPKIT_DEBUG") and e.detail:
            print(e.detail, file=sys.stderr)
        else:
            print("overlapkit demo: set OVERLAPKIT_DEBUG=1 for that rank's traceback", file=sys.stderr)
        return 1


def _writable(folder: str, what: str) -> None:
    # Write a file there: os.access says yes to root for /proc and /sys, where nothing can be created.
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".overlapkit-write-check-")
    except OSError as e:
        raise ValueError(f"{what}: nothing can be written in {folder} ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(probe)


def check_output_path(path: str, flag: str) -> str:
    """Refuse, before any work, a picture path whose folder is missing or unwritable or whose type can't be drawn."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path}: the folder {folder} does not exist")
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path}: is a folder, not a file name")
    _writable(folder, f"{flag} {path}")
    from matplotlib.figure import Figure
    kinds = Figure().canvas.get_supported_filetypes()
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if ext not in kinds:
        raise ValueError(f"{flag} {path}: can't draw a {ext or 'file without an extension'!r}; "
                         f"use one of {', '.join(sorted(kinds))}")
    return path


def check_output_dir(path: str, flag: str) -> str:
    """Refuse, before any work, an output folder that cannot be created or written in."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag} {path}: exists and is not a folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag} {path}: the folder cannot be created ({e.strerror or e})") from None
    _writable(path, f"{flag} {path}")
    return path


def _doctor(args) -> int:
    from .doctor import facts, print_doctor, print_probe
    info = facts()
    if args.probe:
        if not info["cuda_available"]:
            print("overlapkit doctor --probe: needs a CUDA device (it times a GEMM beside transfers on a "
                  "side stream); this machine has none", file=sys.stderr)
            return 2
        from dataclasses import asdict

        from .probe import measure
        info["probe"] = [dict(asdict(c), hidden_fraction=c.hidden_fraction, verdict=c.verdict) for c in measure()]
    if args.json:
        import json
        print(json.dumps(info, indent=2))
    else:
        print_doctor(info)
        if "probe" in info:
            print_probe(info["probe"])
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="overlapkit", description=__doc__)
    parser.add_argument("--version", action="version", version=f"overlapkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train a tiny GPT with TP+SP(+DP) on local ranks and check it against one process")
    demo.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    demo.add_argument("--dp", type=int, default=2, help="data-parallel size (default 2); ranks = tp*dp")
    demo.add_argument("--ep", type=int, default=1,
                      help="expert-parallel size, 1 or dp (default 1): > 1 puts a MoE in every second block")
    demo.add_argument("--cp", type=int, default=1,
                      help="context-parallel size (default 1): > 1 splits each sequence and runs ring attention; ranks = tp*dp*cp")
    demo.add_argument("--pp", type=int, default=1,
                      help="pipeline-parallel size (default 1): > 1 cuts the GPT into stages run with --schedule; ranks = tp*dp*pp")
    demo.add_argument("--schedule", default="1f1b", choices=("1f1b", "interleaved", "zb1p", "zbv", "dualpipev"),
                      help="pipeline schedule with --pp > 1 (default 1f1b): interleaved 1F1B, zero-bubble ZB-H1 (zb1p) "
                           "or ZB-V (zbv), DualPipeV; interleaved, zbv and dualpipev hold two chunks a rank")
    demo.add_argument("--zero", type=int, default=0, choices=(0, 3),
                      help="3: ZeRO-3, the blocks sharded over dp by FSDP2 with chosen prefetch (default 0: DataParallel)")
    demo.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    demo.add_argument("--overlap", default="bulk", choices=OVERLAP_MODES,
                      help="overlap mode of the TP layers (default bulk)")
    demo.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cpu: gloo ranks; cuda: NCCL, a GPU a rank")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--plot", default="timeline.png", help="timeline picture to write ('' for none)")
    demo.add_argument("--trace", metavar="DIR", default=None,
                      help="also write a PyTorch profiler trace per rank to DIR (for overlapkit analyze)")
    demo.add_argument("--timeout", type=float, default=120.0, metavar="S",
                      help="process-group timeout in seconds: a stuck rank fails the demo after this (default 120)")
    demo.add_argument("--oversubscribe", action="store_true",
                      help="start the ranks even when there are far more of them than CPU cores (refused otherwise)")
    demo.set_defaults(func=_demo)

    doctor = sub.add_parser("doctor", help="versions, GPUs, peer access, CUDA_DEVICE_MAX_CONNECTIONS and what it means")
    doctor.add_argument("--json", action="store_true", help="print the facts as JSON")
    doctor.add_argument("--probe", action="store_true",
                        help="measure whether transfers on a side stream really overlap a GEMM on this GPU")
    doctor.set_defaults(func=_doctor)

    from .plan_tools import draw_spans, read_measured

    importlib.import_module("overlapkit.analyze_tool").register(sub)
    # the cost model draws and calibrates through the tools layer: it imports no timeline code itself
    importlib.import_module("overlapkit.costmodel.cli").register(sub, draw=draw_spans, calibrate=read_measured)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:
        # A bad value or an unreadable file the subcommand did not phrase itself: still one line,
        # exit 2 like argparse's own errors. OVERLAPKIT_DEBUG=1 shows where it came from.
        if os.environ.get("OVERLAPKIT_DEBUG"):
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"overlapkit {args.command}: {first}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
