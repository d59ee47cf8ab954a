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

from ..vocabulary import check_bucket_mb, check_prefetch, positive_int
from ._validate import ConfigError
from .flops import CONVENTIONS
from .parallel import (ATTENTION, DTYPES, GRAD_ACCUMULATION, MODES, RECOMPUTE, TRANSPORTS, WEIGHTS, Overlap,
                       ParallelConfig)
from .stacks import Assumption, PlanInputs, assumption_lines, fill_defaults, load_stack, stack_names


MEGATRON_SWITCHES = (
    # (flag, destination, value, help): Megatron-LM's boolean switches, accepted as they are spelled there.
    ("--overlap-grad-reduce", "overlap_dp", "bulk", "= --overlap-dp bulk"),
    ("--overlap-param-gather", "overlap_zero", "pipelined", "= --overlap-zero pipelined"),
    ("--tp-comm-overlap", "overlap_tp", "auto", "= --overlap-tp auto"),
    ("--overlap-p2p-communication", "overlap_pp", "bulk", "= --overlap-pp bulk"),
    ("--use-distributed-optimizer", "zero", 1, "= --zero 1"),
    ("--fp16", "dtype", "fp16", "= --dtype fp16"),
    ("--bf16", "dtype", "bf16", "= --dtype bf16"),
    ("--accumulate-allreduce-grads-in-fp32", "grad_dtype", "fp32", "= --grad-dtype fp32"),
    ("--grad-reduce-in-bf16", "grad_dtype", "bf16", "= --grad-dtype bf16"),
    ("--use-flash-attn", "attention", "flash", "= --attention flash"),
    ("--no-scatter-gather-tensors-in-pipeline", "pp_scatter_gather", False, "= --no-pp-scatter-gather"),
    ("--no-gradient-accumulation-fusion", "grad_accumulation", "hook", "= --grad-accumulation hook"),
)


def _one_line_error(message: str):
    print(f"overlapkit plan: error: {message}", file=sys.stderr)
    sys.exit(2)


def register(subparsers, draw=None, calibrate=None) -> None:
    """Add the `plan` and `bench` subcommands to an argparse subparsers object.

    The tools layer (overlapkit's own command) passes `draw(spans, path, title)`, which draws predicted
    spans with the timeline's picture, and `calibrate(trace_dir) -> costmodel.calibrate.Measured`, which
    reads a profiler trace with the analyzer's reader: the cost model imports neither."""
    p = subparsers.add_parser("plan", help="predict a training step and choose overlap per GEMM",
                              description=__doc__.splitlines()[0])
    p.error = _one_line_error  # argparse's usage + message would be several lines
    p.add_argument("--model", required=True,
                   help="llama3-8b | llama3-70b | llama3-405b | gpt3-175b | file.json (ours or a HuggingFace config.json)")
    p.add_argument("--hardware", help="h100-sxm | h100-sxm-500w | h200-sxm (default) | a100-sxm-80g | "
                   "h800-sxm | a800-sxm-80g | file.json (from `overlapkit bench gemm`)")
    p.add_argument("--stack", help=f"the framework whose implementation settings fill what the flags leave out: "
                   f"{' | '.join(stack_names())} | file.json (same format; docs/model.md)")
    for names, default, text in (
            (("--tp", "--tensor-model-parallel-size"), None, "tensor-parallel size"),
            (("--pp", "--pipeline-model-parallel-size"), None, "pipeline stages"),
            (("--vpp", "--virtual-pipeline-model-parallel-size"), None, "virtual stages per pipeline rank"),
            (("--dp", "--data-parallel-size"), None, "data-parallel size"),
            (("--cp", "--context-parallel-size"), None, "context-parallel size (ring attention over the sequence)"),
            (("--ep", "--expert-model-parallel-size"), None, "expert-parallel size (MoE)"),
            (("--micro-batch", "--micro-batch-size"), None, "sequences per micro-batch"),
            (("--global-batch", "--global-batch-size"), None, "sequences per step (default: one micro-batch per replica)"),
            (("--first-stage-layers", "--decoder-first-pipeline-num-layers"), None, "layers on the first stage (0: even)"),
            (("--last-stage-layers", "--decoder-last-pipeline-num-layers"), None, "layers on the last stage (0: even)"),
            (("--moe-chunks",), None, "token chunks of the MoE all-to-all when EP overlap is on (default 4)"),
            (("--zero3-wrap",), None, "layers per ZeRO-3 / FSDP unit (default 1)"),
            (("--gpus",), None, "GPU count to check tp*cp*pp*dp against")):
        p.add_argument(*names, type=int, default=default, help=text, dest=names[0][2:].replace("-", "_"))
    for names, text in ((("--seq-len", "--seq-length"), "sequence length (replaces the model's)"),
                        (("--experts", "--num-experts"), "experts per MoE layer (replaces the model's)"),
                        (("--top-k", "--moe-router-topk"), "experts per token (replaces the model's)")):
        p.add_argument(*names, type=int, default=None, help=text, dest=names[0][2:].replace("-", "_"))
    p.add_argument("--zero3-prefetch",
                   help="ZeRO-3 prefetch depth in units ahead, or auto (the model's choice, as fully_shard's "
                        "prefetch='auto')")
    p.add_argument("--sp", "--sequence-parallel", action=argparse.BooleanOptionalAction,
                   help="sequence parallelism (default on)")
    p.add_argument("--recompute", "--recompute-granularity", choices=RECOMPUTE,
                   help="none | selective (attention) | op (every other matmul, torchtitan) | full")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="ZeRO stage (default 0)")
    p.add_argument("--overlap", choices=MODES, help="overlap setting of every engine (default none)")
    for engine in ("tp", "dp", "zero", "pp", "ep", "cp"):
        p.add_argument(f"--overlap-{engine}", choices=MODES, help=f"override --overlap for {engine}")
    p.add_argument("--tp-transport", choices=TRANSPORTS, help="default p2p")
    p.add_argument("--dtype", choices=DTYPES, help="default bf16")
    p.add_argument("--grad-dtype", choices=("bf16", "fp16", "fp32"), help="dtype of the DP gradient reduction")
    p.add_argument("--bucket-mb", type=float, help="DP gradient bucket size, MiB (default 25)")
    p.add_argument("--grad-accumulation", choices=GRAD_ACCUMULATION,
                   help="how micro-batch gradients accumulate: fused (in the wgrad GEMM), hook (a buffer add every "
                        "micro-batch: Megatron 2021 local DDP), autograd (in-place into param.grad after the first), "
                        "kept (in place every micro-batch: grads kept by zero_grad(set_to_none=False))")
    p.add_argument("--weights", choices=WEIGHTS,
                   help="master (compute-dtype parameters, fp32 copies in the optimizer: Megatron, DeepSpeed; the "
                        "default) or autocast (fp32 parameters under torch.autocast: plain PyTorch, HF Trainer)")
    p.add_argument("--attention", choices=ATTENTION,
                   help="flash (cuDNN/FA3-class), flash2 (FlashAttention-2-class, 2024 PyTorch SDPA), or unfused "
                        "(scores materialized, softmax + dropout: Megatron before 2022)")
    p.add_argument("--pp-scatter-gather", action=argparse.BooleanOptionalAction,
                   help="pipeline sends split over the TP ranks and re-gathered (Megatron's scatter-gather)")
    p.add_argument("--dp-in-drain", action=argparse.BooleanOptionalAction,
                   help="each stage's DP reduction starts in the pipeline drain, after its last backward")
    p.add_argument("--eager", action="store_true", default=None,
                   help="memory-bound ops one kernel each (no torch.compile/fusion)")
    p.add_argument("--compile", dest="eager", action="store_false", help="fused memory-bound ops (the default)")
    for flag, dest, value, text in MEGATRON_SWITCHES:
        p.add_argument(flag, dest=dest, action="store_const", const=value, help=text)
    p.add_argument("--flops", choices=CONVENTIONS,
                   help="FLOP convention of the TFLOP/s per GPU and MFU printed")
    p.add_argument("--nccl-table", action="append", default=[], metavar="KIND=FILE",
                   help="nccl-tests output replacing the formula for KIND (all_reduce, all_gather, ...)")
    p.add_argument("--json", action="store_true", help="print the prediction as JSON")
    p.add_argument("--plot", metavar="PNG", help="draw the predicted step (and PNG_layer.png: one layer)")
    p.add_argument("--calibrate", metavar="TRACE_DIR",
                   help="profiler traces of one layout of this job (one file per rank): fit its GEMM efficiency, "
                        "collective bandwidths, host time and exposed fractions, then predict the asked layout")
    p.add_argument("--traced", metavar="LAYOUT", default="",
                   help="with --calibrate: the traced layout as flag=value pairs, e.g. 'tp=2,dp=2,micro_batch=1' "
                        "(default: the asked layout itself)")
    p.set_defaults(func=run_plan, draw=draw, read_measured=calibrate)

    b = subparsers.add_parser("bench", help="measure this GPU (CUDA)")
    b.add_argument("what", choices=("gemm",), help="gemm: GEMM-efficiency curve -> hardware JSON")
    b.add_argument("--out", default="hardware.json", help="hardware JSON to write")
    b.add_argument("--base", default=None, help="preset whose links/peaks to keep (default: from the GPU's name)")
    b.add_argument("--quick", action="store_true", help="fewer shapes (a smoke run)")
    b.set_defaults(func=run_bench)


SIZE_FLAGS = {"tp": 1, "pp": 1, "vpp": 1, "dp": 1, "cp": 1, "ep": 1, "micro_batch": 1, "global_batch": 1,
              "first_stage_layers": 0, "last_stage_layers": 0, "moe_chunks": 1, "zero3_wrap": 1, "gpus": 1,
              "seq_len": 1, "experts": 1, "top_k": 1}
"""Integer flags -> their least value; None (left out) takes the default, 0 is not "the default"."""


def _prefetch(text: str):
    """--zero3-prefetch: 'auto' or a depth >= 0, refused in fully_shard's words (vocabulary.check_prefetch)."""
    try:
        value = text if text == "auto" else int(text)
    except ValueError:
        value = text
    return check_prefetch(value, "--zero3-prefetch", error=ConfigError)


def _sizes(args) -> None:
    """Every number the engines take refused with the engines' own validators and words (vocabulary)."""
    for flag, least in SIZE_FLAGS.items():
        if (value := getattr(args, flag)) is not None:
            positive_int(value, f"--{flag.replace('_', '-')}", minimum=least, error=ConfigError)
    check_bucket_mb(args.bucket_mb, "--bucket-mb", error=ConfigError)
    args.zero3_prefetch = _prefetch(args.zero3_prefetch)


def _parallel(args) -> ParallelConfig:
    _sizes(args)
    overlap = Overlap(**{e: getattr(args, f"overlap_{e}") or args.overlap for e in ("tp", "dp", "zero", "pp", "ep", "cp")})
    return ParallelConfig(tp=args.tp, pp=args.pp, vpp=args.vpp, dp=args.dp, cp=args.cp, ep=args.ep, sp=args.sp,
                          micro_batch=args.micro_batch, global_batch=args.global_batch or 0, recompute=args.recompute,
                          zero=args.zero, overlap=overlap, tp_transport=args.tp_transport, dtype=args.dtype,
                          grad_bytes=4 if args.grad_dtype == "fp32" else 2, bucket_mib=args.bucket_mb,
                          grad_accumulation=args.grad_accumulation, weights=args.weights,
                          attention=args.attention, pp_scatter_gather=args.pp_scatter_gather,
                          dp_in_drain=args.dp_in_drain, first_stage_layers=args.first_stage_layers,
                          last_stage_layers=args.last_stage_layers, eager=args.eager, moe_chunks=args.moe_chunks,
                          zero3_prefetch=-1 if args.zero3_prefetch == "auto" else args.zero3_prefetch,
                          zero3_wrap=args.zero3_wrap)


def plan_inputs(args) -> PlanInputs:
    """Fill what the flags leave out from --stack, then overlapkit's defaults, and build the model and split.
    `args` is the parsed `plan` namespace (changed in place: every default filled)."""
    stack = load_stack(args.stack) if args.stack else None
    assumptions = fill_defaults(args, stack)
    par = _parallel(args)
    model = _model(args)
    if args.seq_len is None:
        assumptions.append(Assumption("seq_len", model.seq_len, "model", "the model's own sequence length"))
    if args.global_batch is None:
        assumptions.append(Assumption("global_batch", par.global_batch, "overlapkit default",
                                      "one micro-batch per data-parallel replica"))
    return PlanInputs(model, par, args.hardware, stack.to_dict() if stack else None, tuple(assumptions))


def parse_plan_args(argv: list[str]) -> argparse.Namespace:
    """`overlapkit plan ARGV` parsed as the command parses it (defaults not yet filled: plan_inputs does)."""
    ap = argparse.ArgumentParser(prog="overlapkit")
    register(ap.add_subparsers())
    return ap.parse_args(["plan", *argv])


def plan_json(argv: list[str]) -> dict:
    """What `overlapkit plan ARGV --json` prints, as a dict: the path the published-step validation
    (benchmarks/model_vs_published.py) runs, so that what is validated is what a user runs."""
    args = parse_plan_args(argv)
    if args.calibrate:
        raise ConfigError("plan_json prices the asked layout from the presets; --calibrate needs `overlapkit plan`")
    return _plan_dict(args)[1]


def _plan_dict(args):
    from .advice import plan

    inputs = plan_inputs(args)
    report = plan(inputs.model, inputs.hardware, inputs.par, _tables(args.nccl_table), args.gpus, args.flops)
    return report, _report_dict(report) | {"stack": inputs.stack,
                                           "assumptions": [a.to_dict() for a in inputs.assumptions]}


def _model(args):
    from dataclasses import replace

    from .transformer import load_model

    model = load_model(args.model, args.seq_len)
    changes = {k: x for k, x in (("num_experts", args.experts), ("top_k", args.top_k)) if x is not None}
    return replace(model, **changes) if changes else model


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
    try:
        if args.calibrate:
            return _run_calibrated(args, plan_inputs(args).par)
        if args.traced:
            raise ConfigError("--traced describes the layout of --calibrate's traces: give --calibrate TRACE_DIR")
        report, d = _plan_dict(args)
    except (ConfigError, TypeError, ValueError, OverflowError) as e:  # one line, whatever the input got wrong
        print(f"overlapkit plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(d, indent=1) if args.json else format_report(report) + assumption_lines(d["assumptions"]))
    if args.plot:
        return _plot(report, args)
    return 0


def _run_calibrated(args, par: ParallelConfig) -> int:
    from .calibrate import fit, predict_calibrated, traced_layout
    from .hardware import load_hardware

    if args.read_measured is None:
        raise ConfigError("--calibrate needs overlapkit's trace reader: run it as `overlapkit plan`")
    model, hw = _model(args), load_hardware(args.hardware)
    traced = traced_layout(par, args.traced)
    measured = args.read_measured(args.calibrate)
    cal = fit(measured, model, traced, hw)
    at_traced = predict_calibrated(cal, model, traced)
    report = predict_calibrated(cal, model, par)
    d = report.to_dict() | {"measured_step_s": measured.step_ms * 1e-3,
                            "traced_predicted_step_s": at_traced.step_ms * 1e-3,
                            "traced_layout": cal.traced_summary(), "calibration": cal.to_dict()}
    if args.json:
        print(json.dumps(d, indent=1))
    else:
        err = 100 * (at_traced.step_ms - measured.step_ms) / measured.step_ms
        print(f"calibrated on {args.calibrate} ({measured.steps} step(s), {measured.ranks} rank(s)): traced layout "
              f"{cal.traced_summary()}: measured {measured.step_ms * 1e-3:.4f} s, predicted "
              f"{at_traced.step_ms * 1e-3:.4f} s ({err:+.1f}%)")
        print(cal.summary())
        print()
        print(format_report(report))
    return _plot(report, args, cal.hardware, cal.collectives) if args.plot else 0


def _plot(report, args, hw=None, coll=None) -> int:
    from .hardware import load_hardware
    from .schedule import layer_tasks, step_tasks
    from .simulate import predicted_spans, simulate

    if args.draw is None:
        print("overlapkit plan: --plot needs overlapkit's timeline picture: run it as `overlapkit plan`", file=sys.stderr)
        return 2
    hw = hw or load_hardware(args.hardware)
    path = Path(args.plot)
    layer_path = path.with_name(f"{path.stem}_layer{path.suffix or '.png'}")
    name = f"{report.model.name} on {report.hardware}"
    try:
        args.draw(predicted_spans(simulate(step_tasks(report, hw, coll))), str(path), f"predicted step: {name}")
        args.draw(predicted_spans(simulate(layer_tasks(report))), str(layer_path),
                  f"predicted layer (one micro-batch): {name}")
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


def _report_dict(report) -> dict:
    """report.to_dict() and, with pp > 1, every pipeline schedule priced (schedule.price_pipeline_schedules)."""
    from .schedule import price_pipeline_schedules

    return report.to_dict() | {"pipeline_schedules": price_pipeline_schedules(report)}


def format_report(report) -> str:
    """The plan as text: summary, per kind, per GEMM of one layer, recommendations."""
    d = _report_dict(report)
    p = d["parallel"]
    ov = ", ".join(f"{k}={x}" for k, x in p["overlap"].items())
    out = [f"{d['model']} on {d['hardware']}: tp={p['tp']} cp={p['cp']} pp={p['pp']} vpp={p['vpp']} dp={p['dp']} ep={p['ep']} "
           f"sp={p['sp']} micro-batch={p['micro_batch']} x {p['micro_batches']} recompute={p['recompute']} "
           f"zero={p['zero']} dtype={p['dtype']}; overlap {ov}", "",
           f"step {d['step_time_s']:.4f} s = compute {d['compute_s']:.4f} + exposed comm {d['exposed_comm_s']:.4f} "
           f"+ bubble {d['bubble_s']:.4f} + host {d['host_s']:.4f}   (comm {d['comm_s']:.4f} s, r = {1 - d['exposed_comm_s'] / d['comm_s'] if d['comm_s'] else 1:.2f})",
           _throughput_line(d), _memory_line(d)] + _pipeline_lines(d) + _zero3_lines(d) + [
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


def _throughput_line(d: dict) -> str:
    t = d["throughput"]
    return (f"throughput {t['tflops_per_gpu']:.1f} TFLOP/s per GPU, MFU {100 * t['mfu']:.1f}% "
            f"({t['convention']} FLOPs, {t['step_flops']:.3g} per step, {d['parallel']['world']} GPUs)")


def _memory_line(d: dict) -> str:
    m = d["memory"]
    parts = ", ".join(f"{k} {x:.1f}" for k, x in m["parts_gib"].items() if x >= 0.05)
    head = (f"memory ~{m['total_gib']:.1f} GiB per GPU of {m['capacity_gib']:.0f} ({parts})" if m["fits"] else
            f"WARNING: memory ~{m['total_gib']:.1f} GiB per GPU does not fit the {m['capacity_gib']:.0f} GiB "
            f"of this GPU ({parts})")
    return head


def _pipeline_lines(d: dict) -> list[str]:
    p = d["pipeline"]
    if not p:
        return []
    out = [f"pipeline {p['schedule']} (overlap_p2p {'on' if p['overlap_p2p'] else 'off'}): bubble "
           f"{100 * p['bubble_fraction']:.1f}% of the step (ideal (p-1)/(v*m+p-1) {100 * p['ideal_bubble_fraction']:.1f}%), "
           f"p2p {p['p2p_comm_s']:.4f} s of which {p['p2p_exposed_s']:.4f} s exposed "
           f"({100 * p['p2p_exposed_fraction']:.0f}%)"]
    rows = d.get("pipeline_schedules") or []
    if rows:
        r0 = rows[0]
        out.append(f"pipeline schedules (a stage's micro-batch: F {r0['f_ms']:.2f} + B {r0['b_ms']:.2f} + W "
                   f"{r0['w_ms']:.2f} ms): " + "; ".join(
                       f"{r['schedule']} bubble {r['bubble_s']:.4f} s ({r['bubble_vs_1f1b']:.2f}x 1f1b), "
                       f"{r['activations_stage_microbatches']:g} stage activations, kept W {r['kept_w_gib']:.2f} GiB"
                       for r in rows))
    return out


def _zero3_lines(d: dict) -> list[str]:
    z = d["zero3"]
    if not z:
        return []
    return [f"zero3 prefetch depth {z['prefetch']} unit(s) of {z['wrap_layers']} layer(s) ({z['units']} units per "
            f"stage; gather {z['gather_ms']:.3f} ms, reduce-scatter {z['reduce_scatter_ms']:.3f} ms per unit): "
            f"{z['reason']}"]


def run_bench(args) -> int:
    from .bench_gemm import run

    return run(args)
