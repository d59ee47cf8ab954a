"""What the cross-rank agreement check costs: a new configuration (one store round trip per
rank) against a configuration already seen (a set lookup), on gloo ranks.

Run: python benchmarks/probes/agreement_cost.py --world 4   (CPU here, or the GPU machine's 16 cores)
Writes benchmarks/results/agreement_cost_cpu_ws<N>.{json,md}. Times are per call, per rank,
the median over ranks of each rank's median.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _lib

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _lib.common import add_out_arg, add_smoke_arg, device_label, out_dir, run_ranks, write_results  # noqa: E402


def _rank_body(new_calls: int, seen_calls: int) -> dict:
    from _lib.unexported import Agreement
    from overlapkit import ParallelGroups

    g = ParallelGroups.build(tp=dist.get_world_size())
    a = Agreement("bench")
    first = []
    for i in range(new_calls):  # a new input shape each time: each call compares
        dist.barrier()
        t0 = time.perf_counter()
        a.check(g.tp, shape=(i, 4096), dtype=torch.bfloat16, chunks=4, overlap="pipelined", sequence_parallel=True)
        first.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(seen_calls):  # the steady state: the same shape again
        a.check(g.tp, shape=(0, 4096), dtype=torch.bfloat16, chunks=4, overlap="pipelined", sequence_parallel=True)
    seen = (time.perf_counter() - t0) / seen_calls
    return dict(first_ms=statistics.median(first) * 1e3, seen_us=seen * 1e6)


def markdown(r: dict) -> str:
    return ("| world | new configuration (ms per call) | seen configuration (µs per call) |\n|---|---|---|\n"
            f"| {r['world']} | {r['first_ms']:.3f} | {r['seen_us']:.2f} |\n\n"
            f"{r['device']}, torch {r['torch']}; median over ranks of each rank's median.\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--new-calls", type=int, default=30)
    ap.add_argument("--seen-calls", type=int, default=20000)
    add_out_arg(ap)
    add_smoke_arg(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.new_calls, args.seen_calls = 2, 10
    per_rank = run_ranks(_rank_body, args.world, args.new_calls, args.seen_calls, timeout_s=120.0)
    result = dict(device=device_label("cpu"), torch=torch.__version__, world=args.world,
                  first_ms=statistics.median(r["first_ms"] for r in per_rank),
                  seen_us=statistics.median(r["seen_us"] for r in per_rank))
    write_results(result, os.path.join(out_dir(args), f"agreement_cost_cpu_ws{args.world}"), markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
