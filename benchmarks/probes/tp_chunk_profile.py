"""Where a chunked (pipelined) TP layer's extra device time goes: kernels of overlap none vs pipelined x<tp>.

At world size 1 with TP=<tp> per-rank shapes, `pipelined` with chunks=<tp> runs the chunk GEMMs
and accumulations the TP=<tp> ring would run, without transfers; `tp_host_cost.py` measured it
at 1.35x `none` on the H200 even CUDA-graphed (no host cost left). This profiles one
forward+backward of the TP benchmarks' TPLayer (_lib/tp_layer.py) per variant with torch.profiler and
lists device time per kernel name, so the loss can be assigned to chunk-GEMM efficiency, the
fp32 wgrad accumulation, copies, or something else.

    python benchmarks/probes/tp_chunk_profile.py --device cuda --world 1 --shape-tp 8 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _lib
from _lib.common import add_common_args, device_label, device_slug, out_dir, run_ranks, world_size, write_results
from _lib.presets import MODELS
from _lib.tp_layer import CPU_SHRINK, TPLayer


def _kernel_class(name: str) -> str:
    """A coarse class of a kernel name: what a chunked layer can add."""
    n = name.lower()
    if "gemm" in n or "cutlass" in n or "sm90" in n or "nvjet" in n or "xmma" in n:
        return "GEMM"
    if "copy" in n or "memcpy" in n or "cat" in n:
        return "copy"
    if "reduce" in n or "sum" in n:
        return "reduction"
    if "fill" in n or "memset" in n or "zero" in n:
        return "fill"
    return "elementwise/other"


def _profile(fn, device, steps: int) -> dict:
    for _ in range(3):
        fn()
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                     if device.type == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize(device) if device.type == "cuda" else None
    per_name, per_class, count = defaultdict(float), defaultdict(float), defaultdict(int)
    for e in prof.key_averages():
        # On CPU the ops' own CPU time stands in (no device clock): it shows the script runs.
        us = (e.self_device_time_total if device.type == "cuda" else e.self_cpu_time_total) or 0.0
        if us <= 0 or e.key.startswith("overlapkit"):  # our ranges (GPU annotations) would count twice
            continue
        if device.type == "cuda" and e.device_type != torch.autograd.DeviceType.CUDA:
            continue  # an aten op's row carries its kernels' time: count the kernels once, not the op too
        per_name[e.key] += us / steps
        count[e.key] += e.count // steps
        per_class[_kernel_class(e.key)] += us / steps
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:12]
    return {"total_us": round(sum(per_class.values()), 1), "classes": {k: round(v, 1) for k, v in per_class.items()},
            "top": [(k[:90], round(v, 1), count[k]) for k, v in top]}


def _rank_body(args: dict) -> dict:
    device = torch.device("cuda", dist.get_rank()) if args["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shrink = 1 if device.type == "cuda" else CPU_SHRINK
    tp, out = args["shape_tp"], {}
    for model in args["models"]:
        x = torch.randn(args["tokens"], MODELS[model]["hidden"] // shrink, device=device, dtype=dtype)
        out[model] = {}
        for name, opts in (("none", dict(overlap="none")),
                           (f"pipelined x{tp}", dict(overlap="pipelined", transport="p2p", chunks=tp))):
            torch.manual_seed(0)
            layer = TPLayer(model, shrink, tp, dist.group.WORLD, device, dtype, **opts)
            xg = x.clone().requires_grad_(True)

            def step(layer=layer, xg=xg):
                layer.zero_grad(set_to_none=True)
                xg.grad = None
                layer(xg).sum().backward()
            out[model][name] = _profile(step, device, args["steps"])
    return out


def markdown(result: dict) -> str:
    lines = [f"# Chunked TP layer, kernels — {result['device']}, world 1, TP={result['shape_tp']} per-rank shapes, "
             f"{result['tokens']} tokens, torch {result['torch']}", "",
             "Device time per forward+backward (µs), by kernel class and the top kernels.", ""]
    for model, variants in result["raw"].items():
        classes = sorted({c for v in variants.values() for c in v["classes"]})
        names = list(variants)
        lines += [f"## {model}", "", "| class | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        for c in classes:
            lines.append(f"| {c} | " + " | ".join(f"{variants[n]['classes'].get(c, 0.0):.1f}" for n in names) + " |")
        lines.append("| **total** | " + " | ".join(f"{variants[n]['total_us']:.1f}" for n in names) + " |")
        for n in names:
            lines += ["", f"Top kernels, {n}:", "", "| kernel | µs | calls |", "|---|---:|---:|"]
            lines += [f"| `{k}` | {us:.1f} | {c} |" for k, us, c in variants[n]["top"]]
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument("--shape-tp", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=None, help="tokens (default: 8192 on CUDA, 384 on CPU)")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps per variant")
    ap.add_argument("--models", default=",".join(MODELS))
    a = ap.parse_args(argv)
    if a.smoke:  # one model, 16 tokens, one profiled step
        a.world, a.tokens, a.steps, a.models = a.world or 1, a.tokens or 16, 1, next(iter(MODELS))
    world = world_size(a)
    if world != 1:
        print("tp_chunk_profile runs at world size 1 (pass --world 1)", file=sys.stderr)
        return 2
    args = dict(device=a.device, shape_tp=a.shape_tp, steps=a.steps, models=a.models.split(","),
                tokens=a.tokens or (8192 if a.device == "cuda" else 384))
    (raw,) = run_ranks(_rank_body, 1, args, device=a.device, timeout_s=600.0)
    result = dict(device=device_label(a.device), shape_tp=a.shape_tp, tokens=args["tokens"], torch=torch.__version__,
                  raw=raw)
    write_results(result, os.path.join(out_dir(a), f"tp_chunk_profile_{device_slug(a.device)}_tp{a.shape_tp}"), markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
