"""Where a TP layer step leaves the GPU idle: device gaps inside forward+backward and the host op each one waits for.

A step's device time (CUDA events around it) is its kernels' time plus the gaps between them.
At 70B per-rank shapes of TP=8 the host is far ahead of the device on average, yet the layer
A/B (tp_overlap_h200_ws1_tp8_layers_ab.md) measured +2 % device time for the code with DTensor
parameters, with the same kernels. This profiles `--steps` forward+backward steps of
the TP benchmarks' TPLayer (_lib/tp_layer.py) (overlap none, gradients set to None first), delimits each
step on the device by its record_function range, and reports per step: kernel busy time, span,
the gaps over 5 µs, and for the largest gaps the host op that launched the kernel after it
(the launch was late: the device waited for that op's Python).

    python benchmarks/probes/tp_step_gaps.py --device cuda --world 1 --shape-tp 8 --out benchmarks/results [--tag old]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _lib
from _lib.common import add_common_args, device_label, device_slug, out_dir, run_ranks, world_size, write_results
from _lib.presets import MODELS
from _lib.tp_layer import TPLayer

GAP_US = 5.0
"""Gaps shorter than this are a kernel's own launch spacing, not waiting."""


def _step_gaps(trace: dict, steps: int) -> dict:
    ev = trace["traceEvents"]
    kernels = sorted((e for e in ev if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    marks = sorted((e for e in ev if e.get("cat") == "gpu_user_annotation" and e.get("name") == "step"),
                   key=lambda e: e["ts"])[-steps:]
    # cuBLAS launches its GEMMs through the driver API (cuLaunchKernelEx), the rest through the runtime
    launch = {e["args"].get("correlation"): e for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver")}
    cpu_ops = sorted((e for e in ev if e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
    per_step, late, last = [], {}, []
    # A step is everything from its mark's start to the next step's: the mark itself covers only
    # the kernels launched from the calling thread (the forward), not the backward's, which the
    # autograd engine launches from its own thread. Steps are synchronized, so none overlap.
    bounds = [m["ts"] for m in marks] + [float("inf")]
    for i, m in enumerate(marks):
        ks = [k for k in kernels if bounds[i] <= k["ts"] < bounds[i + 1]]
        if not ks:
            continue
        last = ks
        busy = sum(k["dur"] for k in ks)
        span = ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]
        gaps = []
        for a, b in zip(ks, ks[1:]):
            g = b["ts"] - (a["ts"] + a["dur"])
            if g > GAP_US:
                gaps.append((g, b))
        per_step.append(dict(busy_us=busy, span_us=span, gap_us=sum(g for g, _ in gaps), gaps=len(gaps)))
        for g, b in gaps:
            rt = launch.get(b["args"].get("correlation"))
            if rt is None:
                continue
            # the host ops open at the launch: the innermost is the op whose Python the device waited
            # for, the outermost below the step says which layer or engine phase it belongs to
            owner = [c for c in cpu_ops if c["ts"] <= rt["ts"] <= c["ts"] + c["dur"] and c.get("tid") == rt.get("tid")]
            inner = min(owner, key=lambda c: c["dur"])["name"] if owner else "(no op)"
            below = [c for c in owner if c["name"] != "step" and c["dur"] < max(o["dur"] for o in owner)]
            outer = max(below, key=lambda c: c["dur"])["name"] if below else ""
            name = f"{inner} in {outer}" if outer and outer != inner else inner
            late[name] = late.get(name, 0.0) + g
    n = len(per_step) or 1
    return {"steps": len(per_step), "largest_gap": _host_between(last, cpu_ops, launch),
            **{k: round(statistics.median(s[k] for s in per_step), 1) for k in ("busy_us", "span_us", "gap_us", "gaps")},
            "late_launch_us_per_step": dict(sorted(((k, round(v / n, 1)) for k, v in late.items()),
                                                   key=lambda kv: -kv[1])[:10])}


def _host_between(ks: list, cpu_ops: list, launch: dict) -> list:
    """The last step's largest gap: the outermost host ops between the launches of the kernels
    around it (what the host did while the device waited), as (name, µs) in order."""
    best = max(((b["ts"] - a["ts"] - a["dur"], a, b) for a, b in zip(ks, ks[1:])), key=lambda t: t[0], default=None)
    if best is None:
        return []
    g, a, b = best
    la, lb = launch.get(a["args"].get("correlation")), launch.get(b["args"].get("correlation"))
    if la is None or lb is None:
        return [("gap", round(g, 1))]
    inside = [c for c in cpu_ops if la["ts"] <= c["ts"] <= lb["ts"]]
    outer = [c for c in inside if not any(o is not c and o["ts"] <= c["ts"] and c["ts"] + c["dur"] <= o["ts"] + o["dur"]
                                          for o in inside)]
    return [("gap", round(g, 1)), ("kernel after", b["name"][:60])] + [(c["name"][:60], round(c["dur"], 1))
                                                                        for c in outer[:25]]


def _rank_body(args: dict) -> dict:
    device = torch.device("cuda", dist.get_rank())
    torch.cuda.set_device(device)
    out = {}
    for model in args["models"]:
        x = torch.randn(args["tokens"], MODELS[model]["hidden"], device=device, dtype=torch.bfloat16,
                        requires_grad=True)
        layer = TPLayer(model, 1, args["shape_tp"], dist.group.WORLD, device, torch.bfloat16, overlap="none")

        def step():
            layer.zero_grad(set_to_none=True)
            x.grad = None
            with torch.profiler.record_function("step"):
                layer(x).sum().backward()
        for _ in range(5):
            step()
        torch.cuda.synchronize(device)
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(args["steps"]):
                step()
                torch.cuda.synchronize(device)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                out[model] = _step_gaps(json.load(f), args["steps"])
    return out


def markdown(result: dict) -> str:
    lines = [f"# TP layer step, device gaps — {result['device']}, world 1, TP={result['shape_tp']} per-rank shapes, "
             f"{result['tokens']} tokens, bf16, overlap none, torch {result['torch']}{result['tag_note']}", "",
             f"Median over {result['steps']} forward+backward steps: kernel busy time, span first kernel start to last "
             f"end, gaps over {GAP_US:g} µs between kernels; then the host ops whose late launches the gaps waited "
             "on (µs per step).", "", "| model | busy µs | span µs | gap µs | gaps | late launches (op: µs/step) |",
             "|---|---:|---:|---:|---:|---|"]
    for model, r in result["raw"].items():
        late = "; ".join(f"`{k[:90]}` {v}" for k, v in r["late_launch_us_per_step"].items())
        lines.append(f"| {model} | {r['busy_us']} | {r['span_us']} | {r['gap_us']} | {r['gaps']} | {late} |")
    lines += ["", "The last step's largest gap, and the outermost host ops between the launches around it (µs):", ""]
    for model, r in result["raw"].items():
        lines.append(f"- {model}: " + "; ".join(f"{k} {v}" for k, v in r.get("largest_gap", [])))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument("--shape-tp", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--models", default="llama3-8b,llama3-70b")
    ap.add_argument("--tag", default="", help="suffix of the result files (e.g. old / new for an A/B)")
    args = ap.parse_args(argv)
    if args.smoke:  # on the GPU: one model, 256 tokens, two profiled steps
        args.world, args.models, args.tokens, args.steps = args.world or 1, "llama3-8b", 256, 2
    if args.device != "cuda" or world_size(args) != 1:
        print("tp_step_gaps needs CUDA (device kernels and their gaps) and runs at world size 1 (--world 1)",
              file=sys.stderr)
        return 2
    body = dict(models=args.models.split(","), shape_tp=args.shape_tp, tokens=args.tokens, steps=args.steps)
    (raw,) = run_ranks(_rank_body, 1, body, device=args.device, timeout_s=600.0)
    import overlapkit
    src = os.path.dirname(overlapkit.__file__)
    result = dict(device=device_label(args.device), shape_tp=args.shape_tp, tokens=args.tokens, steps=args.steps,
                  torch=torch.__version__, source=src, tag_note=f" ({args.tag}: {src})" if args.tag else "", raw=raw)
    name = f"tp_step_gaps_{device_slug(args.device)}_tp{args.shape_tp}" + (f"_{args.tag}" if args.tag else "")
    write_results(result, os.path.join(out_dir(args), name), markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
