"""Why a compiled parallelized step differs from the compiled plain one: kernels, host syncs and idle GPU, side by side.

The user's step (benchmarks/user_step.py: HF Llama, labels=, clip_grad_norm_, AdamW) of two variants,
each torch.compile'd, one profiled step each after warm-up: wall time, the GPU's busy time (the union
of its kernels), the host calls that wait for the GPU (stream/device synchronizations, copies to the
host), and the kernels whose total time differs most between the two.

    python benchmarks/probes/compiled_step_profile.py --device cuda --layers 4          # one GPU
    python benchmarks/probes/compiled_step_profile.py --smoke                            # CPU smoke run (eager variants)
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _lib

import torch  # noqa: E402

from _lib.common import add_out_arg, add_smoke_arg, device_label, out_dir, run_ranks, write_results  # noqa: E402
from _lib.hf_llama import PRESETS, build_variant  # noqa: E402

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ", "cudaMemcpyAsync")


def _busy_ms(intervals) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total / 1e3


def _rank_body(cfg_kw: dict, variants: list[str], warmup: int, device_type: str) -> dict:
    import overlapkit
    from torch.profiler import ProfilerActivity, profile
    from transformers import LlamaConfig, LlamaForCausalLM

    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    groups = overlapkit.init(tp=1, dp=1)
    kw = {k: v for k, v in cfg_kw.items() if k not in ("batch", "seq")}
    cfg = LlamaConfig(**kw, max_position_embeddings=cfg_kw["seq"], attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        base = LlamaForCausalLM(cfg).to(torch.bfloat16 if device_type == "cuda" else torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (cfg_kw["batch"], cfg_kw["seq"])).to(device)
    out = {}
    for name in variants:
        model, ctx = build_variant(name, base, groups, 1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **(dict(fused=True) if device_type == "cuda" else {}))

        def step():
            with ctx():
                model(input_ids=ids, labels=ids).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        for _ in range(warmup):
            step()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])
        if device_type == "cuda":
            torch.cuda.synchronize()
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            step()
            if device_type == "cuda":
                torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3
        kernels, syncs, spans = collections.Counter(), collections.Counter(), []
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kernels[e.name[:80]] += e.device_time / 1e3
                spans.append((e.time_range.start, e.time_range.end))
            elif any(e.name.startswith(s) for s in SYNCS):
                syncs[e.name] += 1
        out[name] = dict(wall_ms=wall, gpu_busy_ms=_busy_ms(spans), syncs=dict(syncs), kernels=dict(kernels))
        del model, opt
    return out


def _markdown(result: dict) -> str:
    a, b = result["variants"]
    ra, rb = result["rows"][a], result["rows"][b]
    lines = [f"One profiled compiled step, {result['device']}, HF Llama {result['config']}, torch {result['torch']}\n",
             f"| | {a} | {b} |", "|---|---:|---:|",
             f"| wall ms | {ra['wall_ms']:.1f} | {rb['wall_ms']:.1f} |",
             f"| GPU busy ms | {ra['gpu_busy_ms']:.1f} | {rb['gpu_busy_ms']:.1f} |"]
    for s in sorted(set(ra["syncs"]) | set(rb["syncs"])):
        lines.append(f"| host waits: {s} | {ra['syncs'].get(s, 0)} | {rb['syncs'].get(s, 0)} |")
    diff = sorted(set(ra["kernels"]) | set(rb["kernels"]),
                  key=lambda k: -abs(rb["kernels"].get(k, 0) - ra["kernels"].get(k, 0)))[:12]
    lines += ["", f"| kernel (largest differences) | {a} ms | {b} ms |", "|---|---:|---:|"]
    lines += [f"| `{k}` | {ra['kernels'].get(k, 0):.2f} | {rb['kernels'].get(k, 0):.2f} |" for k in diff]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--variants", default="plain_compiled,ok_none_compiled")
    add_out_arg(ap)
    add_smoke_arg(ap)
    args = ap.parse_args(argv)
    if args.smoke:  # the tiny config, one layer and 32 tokens, the same two variants uncompiled (no compile time)
        args.preset, args.layers, args.seq, args.warmup, args.variants = "tiny", 1, 32, 1, "plain,ok_none"
    cfg = dict(PRESETS[args.preset], num_hidden_layers=args.layers)
    if args.seq:
        cfg["seq"] = args.seq
    variants = args.variants.split(",")
    per_rank = run_ranks(_rank_body, 1, cfg, variants, args.warmup, args.device, device=args.device, timeout_s=600)
    result = dict(device=device_label(args.device), torch=torch.__version__, config=cfg, variants=variants,
                  rows=per_rank[0])
    write_results(result, os.path.join(out_dir(args), f"compiled_step_profile_{args.device}"), _markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
