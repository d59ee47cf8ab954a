"""`overlapkit plan` and `overlapkit bench gemm`: predict what overlap hides, measure GEMMs.

`plan` prints the predicted step (compute, communication, exposed communication, r per kind),
the TP overlap chosen per GEMM of a layer, and which switch to turn on next. Bad input exits 2
with one line naming the field. `bench gemm` measures this GPU's GEMM curve (CUDA only).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ._validate import ConfigError
from .transformer import MODES, RECOMPUTE, TRANSPORTS, Overlap, ParallelConfig


def register(subparsers) -> None:
    """Add the `plan` and `bench` subcommands to an argparse subparsers object."""
    p = subparsers.add_parser("plan", help="predict a training step and choose overlap per GEMM",
                              description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="llama3-8b | llama3-70b | llama3-405b | gpt3-175b | file.json")
    p.add_argument("--hardware", default="h200-sxm", help="h100-sxm | h200-sxm | a100-sxm-80g | h800-sxm | "
                   "a800-sxm-80g | file.json (from `overlapkit bench gemm`)")
    for name, default, text in (("tp", 1, "tensor-parallel size"), ("pp", 1, "pipeline stages"),
                                ("vpp", 1, "virtual stages per pipeline rank"), ("dp", 1, "data-parallel size"),
                                ("ep", 1, "expert-parallel size (MoE)"), ("micro-batch", 1, "sequences per micro-batch"),
                                ("global-batch", 0, "sequences per step (0: one micro-batch per replica)"),
                                ("gpus", None, "GPU count to check tp*pp*dp against")):
        p.add_argument(f"--{name}", type=int, default=default, help=text)
    p.add_argument("--sp", action=argparse.BooleanOptionalAction, default=True, help="sequence parallelism")
    p.add_argument("--recompute", choices=RECOMPUTE, default="none")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0)
    p.add_argument("--overlap", choices=MODES, default="none", help="overlap setting of every engine")
    for engine in ("tp", "dp", "zero", "pp", "ep"):
        p.add_argument(f"--overlap-{engine}", choices=MODES, help=f"override --overlap for {engine}")
    p.add_argument("--tp-transport", choices=TRANSPORTS, default="p2p")
    p.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16")
    p.add_argument("--nccl-table", action="append", default=[], metavar="KIND=FILE",
                   help="nccl-tests output replacing the formula for KIND (all_reduce, all_gather, ...)")
    p.add_argument("--json", action="store_true", help="print the prediction as JSON")
    p.add_argument("--plot", metavar="PNG", help="draw the predicted step (and PNG_layer.png: one layer)")
    p.set_defaults(func=run_plan)

    b = subparsers.add_parser("bench", help="measure this GPU (CUDA)")
    b.add_argument("what", choices=("gemm",), help="gemm: GEMM-efficiency curve -> hardware JSON")
    b.add_argument("--out", default="hardware.json", help="hardware JSON to write")
    b.add_argument("--base", default=None, help="preset whose links/peaks to keep (default: from the GPU's name)")
    b.add_argument("--quick", action="store_true", help="fewer shapes (a smoke run)")
    b.set_defaults(func=run_bench)


def _parallel(args) -> ParallelConfig:
    overlap = Overlap(**{e: getattr(args, f"overlap_{e}") or args.overlap for e in ("tp", "dp", "zero", "pp", "ep")})
    return ParallelConfig(tp=args.tp, pp=args.pp, vpp=args.vpp, dp=args.dp, ep=args.ep, sp=args.sp,
                          micro_batch=args.micro_batch, global_batch=args.global_batch, recompute=args.recompute,
                          zero=args.zero, overlap=overlap, tp_transport=args.tp_transport, dtype=args.dtype)


def _tables(specs: list[str]):
    from .collectives import parse_nccl_tests

    tables = []
    for spec in specs:
        kind, sep, path = spec.partition("=")
        if not sep:
            raise ConfigError(f"nccl-table={spec!r}: expected KIND=FILE")
        if not Path(path).is_file():
            raise ConfigError(f"nccl-table={spec!r}: no such file {path!r}")
        tables.append(parse_nccl_tests(Path(path).read_text(), kind))
    return tables


def run_plan(args) -> int:
    from .advice import plan

    try:
        report = plan(args.model, args.hardware, _parallel(args), _tables(args.nccl_table), args.gpus)
    except ConfigError as e:
        print(f"overlapkit plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=1) if args.json else format_report(report))
    if args.plot:
        return _plot(report, args)
    return 0


def _plot(report, args) -> int:
    from .hardware import load_hardware
    from .schedule import layer_tasks, step_tasks
    from .simulate import plot, simulate

    hw = load_hardware(args.hardware)
    path = Path(args.plot)
    layer_path = path.with_name(f"{path.stem}_layer{path.suffix or '.png'}")
    name = f"{report.model.name} on {report.hardware}"
    try:
        plot(simulate(step_tasks(report, hw)), str(path), title=f"predicted step: {name}")
        plot(simulate(layer_tasks(report)), str(layer_path), title=f"predicted layer (one micro-batch): {name}")
    except RuntimeError as e:
        print(f"overlapkit plan: {e}", file=sys.stderr)
        return 1
    print(f"wrote {path} and {layer_path}", file=sys.stderr)
    return 0


def _table(header: list[str], rows: list[list]) -> str:
    cells = [header] + [[c if isinstance(c, str) else f"{c:.3f}" if isinstance(c, float) else str(c) for c in r]
                        for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def format_report(report) -> str:
    """The plan as text: summary, per kind, per GEMM of one layer, recommendations."""
    d = report.to_dict()
    p = d["parallel"]
    ov = ", ".join(f"{k}={x}" for k, x in p["overlap"].items())
    out = [f"{d['model']} on {d['hardware']}: tp={p['tp']} pp={p['pp']} vpp={p['vpp']} dp={p['dp']} ep={p['ep']} "
           f"sp={p['sp']} micro-batch={p['micro_batch']} x {p['micro_batches']} recompute={p['recompute']} "
           f"zero={p['zero']} dtype={p['dtype']}; overlap {ov}", "",
           f"step {d['step_time_s']:.4f} s = compute {d['compute_s']:.4f} + exposed comm {d['exposed_comm_s']:.4f} "
           f"+ bubble {d['bubble_s']:.4f}   (comm {d['comm_s']:.4f} s, r = {1 - d['exposed_comm_s'] / d['comm_s'] if d['comm_s'] else 1:.2f})",
           "", _table(["kind", "comm s", "exposed s", "r"],
                      [[k, x["comm_s"], x["exposed_s"], x["r"]] for k, x in d["by_kind"].items()]),
           "", f"one layer, one micro-batch ({d['layers_per_stage']} layers per stage), ms:",
           _table(["phase", "op", "m", "k", "n", "gemm", "comm", "comm ms", "mode", "chunks", "exposed"],
                  [[r["phase"], r["op"], r.get("m", ""), r.get("k", ""), r.get("n", ""), r["gemm_ms"],
                    r.get("comm", ""), r.get("comm_ms", ""), r.get("mode", ""), r.get("chunks", ""),
                    r.get("exposed_ms", "")] for r in d["layer_rows"]])]
    if d["recommendations"]:
        out += ["", "turn on next:", _table(["to hide", "switch", "needs", "saves s", "saves %"],
                                            [[r["want"], r["switch"], r["prerequisite"], r["saving_s"],
                                              f"{r['saving_pct']:.1f}"] for r in d["recommendations"]])]
    if d["notes"]:
        out += ["", "where overlap cannot help:"] + [f"  - {n}" for n in d["notes"]]
    return "\n".join(out)


def run_bench(args) -> int:
    from .bench_gemm import run

    return run(args)
