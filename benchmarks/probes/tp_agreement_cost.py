"""What the TP layers' cross-rank checks cost: construction, first forward of a shape, steady state.

A layer compares its arguments across the TP group when built and each new input signature
the first time it sees it (a store round trip each); afterwards a seen input is a dict lookup
before the GEMM. This measures each, per rank, and
reports the slowest rank's median:
- `agree` alone (one store round trip), construction of a ColumnParallelLinear,
- the first forward of a new shape vs the steady-state forward (their difference is the check).
(The steady-state entry alone, a private method the layer no longer has, is not timed: a seen input is one
dict lookup inside forward now, part of the steady-state forward.)

    python benchmarks/probes/tp_agreement_cost.py --world 2 --threads 1 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _lib
from _lib.common import add_common_args, device_label, out_dir, run_ranks, world_size, write_results  # noqa: E402


def _ms(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def _measure(device: str, threads: int, h: int, tokens: int, reps: int) -> dict:
    import torch.distributed as dist

    from _lib.unexported import agree
    from overlapkit.tensor_parallel import ColumnParallelLinear

    torch.set_num_threads(threads)
    group, dev = dist.group.WORLD, torch.device(device)
    n = [0]

    def one_agree():
        n[0] += 1
        agree(group, f"probe{n[0]}", shape=(tokens, h), dtype="float32", chunks=None)

    out = {"agree_ms": _ms(one_agree, reps)}
    out["construct_ms"] = _ms(lambda: ColumnParallelLinear(h, h, group, sequence_parallel=True, device=dev), reps)
    layer = ColumnParallelLinear(h, h, group, sequence_parallel=True, device=dev)
    ws = dist.get_world_size()
    first = []
    with torch.no_grad():
        for i in range(reps):  # each a new sequence length: a first call every time
            x = torch.randn(tokens // ws + i + 1, h, device=dev)
            dist.barrier()
            t0 = time.perf_counter()
            layer(x)
            first.append((time.perf_counter() - t0) * 1e3)
        x = torch.randn(tokens // ws, h, device=dev)
        layer(x)
        out["first_forward_ms"] = statistics.median(first)
        out["steady_forward_ms"] = _ms(lambda: layer(x), 5 * reps)
    gathered = [None] * ws
    dist.all_gather_object(gathered, out)
    return {k: max(g[k] for g in gathered) for k in out}


def _markdown(r: dict) -> str:
    m = r["measured"]
    return (f"TP layer agreement cost, {r['device']}, world {r['world']}, {r['threads']} thread(s) per rank, "
            f"ColumnParallelLinear({r['hidden']}, {r['hidden']}) with SP, {r['tokens']} tokens, torch "
            f"{r['torch']}. Median, slowest rank.\n\n"
            "| what | cost |\n|---|---:|\n"
            f"| one `agree` (store round trip) | {m['agree_ms']:.3f} ms |\n"
            f"| construction (agree + nn.Linear init of the full weight) | {m['construct_ms']:.3f} ms |\n"
            f"| first forward of a new shape | {m['first_forward_ms']:.3f} ms |\n"
            f"| steady-state forward | {m['steady_forward_ms']:.3f} ms |\n"
            f"| first − steady (the shape check) | {m['first_forward_ms'] - m['steady_forward_ms']:.3f} ms |\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if args.smoke:
        args.hidden, args.tokens, args.reps = 32, 8, 2
    ws = world_size(args)
    if ws is None:
        sys.exit(1)
    per_rank = run_ranks(_measure, ws, args.device, args.threads, args.hidden, args.tokens, args.reps,
                         device=args.device, timeout_s=120)
    result = dict(device=device_label(args.device), world=ws, threads=args.threads, hidden=args.hidden,
                  tokens=args.tokens, torch=torch.__version__, measured=per_rank[0])
    write_results(result, os.path.join(out_dir(args), f"tp_agreement_{args.device}_ws{ws}"), _markdown)


if __name__ == "__main__":
    main()
