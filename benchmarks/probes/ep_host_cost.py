"""What one MoE call costs the host, beside a dense MLP of the same active parameters: aten ops dispatched
per forward and backward (each a dispatch, most a kernel launch on a GPU) and host time per call, for the
dropless path and a capacity through the padded (no host sync) and the exact-count path, at one rank.

On a CPU the shapes are tiny (the step is host-bound, as the GPU's is) and the experts take the GPUs'
grouped-GEMM path (switched on for CPU here), so the ops counted are those a GPU runs. On CUDA the shapes
are ep_overlap.py's, and host time is the time until the calls return (the device finishes after them).

    python benchmarks/probes/ep_host_cost.py                      # CPU proxy (1 thread)
    python benchmarks/probes/ep_host_cost.py --device cuda        # one GPU

Writes benchmarks/results/ep_host_cost_<device>.json and .md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _lib
from _lib.common import add_common_args, device_label, init_one_rank, out_dir, write_results
from _lib.ops import layer_ops
from _lib.ratios import per_round, text
from _lib.unexported import GROUPED_DEVICES
from overlapkit.expert_parallel import MoE

SHAPES = {"cpu": dict(hidden=32, ffn=32, experts=8, top_k=2, tokens=64, dtype="float32"),
          "cuda": dict(hidden=2048, ffn=1408, experts=8, top_k=2, tokens=8192, dtype="bfloat16")}
VARIANTS = {"dropless": dict(), "capacity padded": dict(capacity_factor=1.25, pad_to_capacity=True),
            "capacity exact": dict(capacity_factor=1.25, pad_to_capacity=False)}
MLP = "dense MLP"


def _layers(p: dict, device, dtype) -> dict:
    out = {}
    for name, kw in VARIANTS.items():
        torch.manual_seed(0)
        out[name] = MoE(p["hidden"], p["ffn"], p["experts"], p["top_k"], dist.group.WORLD, chunks=1, device=device,
                        dtype=dtype, **kw)
    out[MLP] = torch.nn.Sequential(torch.nn.Linear(p["hidden"], p["top_k"] * p["ffn"]), torch.nn.GELU(),
                                   torch.nn.Linear(p["top_k"] * p["ffn"], p["hidden"])).to(device, dtype)
    return out


def _host_us(layer, x, dy, backward: bool, reps: int, device) -> float:
    xg = x.detach().requires_grad_(backward)
    t0 = time.perf_counter()
    for _ in range(reps):
        with torch.enable_grad() if backward else torch.no_grad():
            out = layer(xg)
            if backward:
                out.backward(dy)
    host = (time.perf_counter() - t0) * 1e6 / reps
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    layer.zero_grad(set_to_none=True)
    return host


def run(device_type: str, p: dict, rounds: int, reps: int) -> dict:
    device = torch.device(device_type)
    dtype = getattr(torch, p["dtype"])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(p["tokens"], p["hidden"], generator=g).to(device, dtype)
    dy = torch.randn(p["tokens"], p["hidden"], generator=g).to(device, dtype)
    layers = _layers(p, device, dtype)
    ops = {name: layer_ops(layer, x, dy) for name, layer in layers.items()}
    times = {f"{n}|{m}": [] for n in layers for m in ("fwd", "fwd+bwd")}
    keys = list(times)
    for r in range(rounds + 1):  # round 0 warms up; the order rotates so that none always runs first
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            name, mode = k.split("|")
            t = _host_us(layers[name], x, dy, mode == "fwd+bwd", reps, device)
            if r:
                times[k].append(t)
    rows = []
    for name in layers:
        row = dict(variant=name, ops=ops[name])
        for mode in ("fwd", "fwd+bwd"):
            row[f"{mode}_us"] = statistics.median(times[f"{name}|{mode}"])
            if name != MLP:
                row[f"{mode}_vs_mlp"] = per_round(times[f"{name}|{mode}"], times[f"{MLP}|{mode}"])
        rows.append(row)
    return dict(rows=rows, times=times)


def markdown(r: dict) -> str:
    p = r["shape"]
    head = (f"MoE host cost, {r['device']}, {r['threads']} thread(s), torch {r['torch']}, one rank, chunks=1: hidden "
            f"{p['hidden']}, expert ffn {p['ffn']}, {p['experts']} experts, top-{p['top_k']}, {p['tokens']} tokens, "
            f"{p['dtype']}; capacity factor 1.25; the dense MLP has inner width top_k x ffn. {r['note']} Host µs per "
            f"call: medians of {r['rounds']} rounds of {r['reps']} calls; ratios to the MLP per round (middle half). "
            "Ops: aten ops dispatched in one forward without grad, one with grad, and its backward; in brackets those "
            "that are not views or allocations.\n\n")
    lines = ["| variant | ops fwd | ops fwd (grad) | ops bwd | host µs fwd | fwd vs MLP | host µs fwd+bwd | "
             "fwd+bwd vs MLP |", "|---|---:|---:|---:|---:|---|---:|---|"]
    for row in r["rows"]:
        o = {k: f"{v['ops']} ({v['kernels']})" for k, v in row["ops"].items()}
        lines.append(f"| {row['variant']} | {o['fwd']} | {o['fwd_grad']} | {o['bwd']} | {row['fwd_us']:.0f} | "
                     f"{text(row.get('fwd_vs_mlp'))} | {row['fwd+bwd_us']:.0f} | {text(row.get('fwd+bwd_vs_mlp'))} |")
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--reps", type=int, default=20, help="calls per round")
    ap.add_argument("--label", default="", help="appended to the results' file name (e.g. a source's name)")
    a = ap.parse_args(argv)
    if a.smoke:
        a.rounds, a.reps = 2, 2
    if a.device == "cuda" and not torch.cuda.is_available():
        print("ep_host_cost: --device cuda needs CUDA", file=sys.stderr)
        return 2
    torch.set_num_threads(a.threads)
    note = "The GPU path (grouped GEMMs) switched on for CPU: the ops are a GPU's." if a.device == "cpu" else ""
    if a.device == "cpu":
        GROUPED_DEVICES.add("cpu")
    init_one_rank("gloo")
    p = SHAPES[a.device]
    r = dict(device=device_label(a.device), threads=a.threads, torch=torch.__version__, shape=p, note=note,
             rounds=a.rounds, reps=a.reps, **run(a.device, p, a.rounds, a.reps))
    write_results(r, os.path.join(out_dir(a), f"ep_host_cost_{a.device}{a.label}"), markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
