"""Where one MoE forward spends its time on a GPU: host (self CPU time per op) and device (kernels),
at the EP benchmark's shapes on one rank. What the layer's fixed cost over a dense MLP is made of.

    python benchmarks/ep_profile.py
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from _common import RESULTS, write_results  # noqa: E402
from overlapkit.expert_parallel import MoE  # noqa: E402


def run(chunks: int, reps: int) -> dict:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    moe = MoE(2048, 1408, 8, 2, dist.group.WORLD, chunks=chunks, device=dev, dtype=torch.bfloat16)
    x = torch.randn(8192, 2048, device=dev, dtype=torch.bfloat16)
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
             "hidden 2048, expert ffn 1408, 8 experts, top-2, 8192 tokens, bf16, one rank, no grad; "
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
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("CUDA only", file=sys.stderr)
        return 2
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29735", rank=0, world_size=1)
    r = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": [run(c, a.reps) for c in (1, 4)]}
    write_results(r, os.path.join(a.out, "ep_profile_h200"), markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
