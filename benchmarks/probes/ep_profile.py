"""Where one MoE forward spends its time on a GPU: host (self CPU time per op) and device (kernels),
at the EP benchmark's shapes on one rank. What the layer's fixed cost over a dense MLP is made of.

    python benchmarks/probes/ep_profile.py
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _lib
from _lib.common import add_out_arg, add_smoke_arg, init_one_rank, out_dir, write_results
from overlapkit.expert_parallel import MoE

SHAPE = dict(hidden=2048, ffn=1408, experts=8, top_k=2, tokens=8192)
"""The EP benchmark's CUDA shapes (ep_overlap.py's cuda preset) on one rank."""
SMOKE = dict(hidden=64, ffn=128, experts=4, top_k=2, tokens=256)


def run(chunks: int, reps: int, p: dict = SHAPE) -> dict:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    moe = MoE(p["hidden"], p["ffn"], p["experts"], p["top_k"], dist.group.WORLD, chunks=chunks, device=dev,
              dtype=torch.bfloat16)
    x = torch.randn(p["tokens"], p["hidden"], device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(3):
            moe(x)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            moe(x)
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / reps
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                moe(x)
            torch.cuda.synchronize()
    ev = prof.key_averages()
    host = sorted(((e.key, e.self_cpu_time_total / reps / 1e3, e.count // reps) for e in ev), key=lambda t: -t[1])
    # Kernels only: an aten op's or a named range's device time is its kernels' again.
    dev_t = sorted(((e.key, e.self_device_time_total / reps / 1e3) for e in ev if e.self_device_time_total > 0
                    and not e.key.startswith(("aten::", "overlapkit.", "ExpertsA2A"))), key=lambda t: -t[1])
    return {"chunks": chunks, "wall_ms": wall, "host_self_ms": sum(t[1] for t in host),
            "device_ms": sum(t[1] for t in dev_t), "host_top": host[:20], "device_top": dev_t[:12]}


def markdown(r: dict) -> str:
    lines = [f"# One MoE forward on {r['device']}, torch {r['torch']}: host and device time", "",
             "hidden {hidden}, expert ffn {ffn}, {experts} experts, top-{top_k}, {tokens} tokens, bf16, one rank, no grad; "
             .format(**r.get("shape", SHAPE)) +
             "per forward, means over the profiled calls (wall: synchronized calls, unprofiled).", ""]
    for row in r["rows"]:
        lines += [f"## chunks = {row['chunks']}: wall {row['wall_ms']:.2f} ms, host self time {row['host_self_ms']:.2f} ms, "
                  f"device (kernels) {row['device_ms']:.2f} ms", "", "| op (host) | self CPU ms | calls |", "|---|---:|---:|"]
        lines += [f"| `{k[:80]}` | {t:.3f} | {n} |" for k, t, n in row["host_top"]]
        lines += ["", "| kernel | device ms |", "|---|---:|"] + [f"| `{k[:90]}` | {t:.3f} |" for k, t in row["device_top"]]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_arg(ap)
    ap.add_argument("--reps", type=int, default=10)
    add_smoke_arg(ap)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("ep_profile: CUDA only (device time per kernel)", file=sys.stderr)
        return 2
    init_one_rank("gloo")
    p = SMOKE if a.smoke else SHAPE
    r = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "shape": p,
         "rows": [run(c, 2 if a.smoke else a.reps, p) for c in (1, 4)]}
    write_results(r, os.path.join(out_dir(a), "ep_profile_h200"), markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
