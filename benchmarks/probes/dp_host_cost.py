"""Host cost of a data-parallel step, side by side in one run: overlapkit DataParallel (its
defaults, and overlap=False), PyTorch DDP and the same model with no data parallelism at all,
on a model of many small parameters, where the per-parameter bookkeeping (gradient hooks,
bucket readiness, launches) is most of the step.

At world size 1 nothing needs to travel: the question is only what each engine's bookkeeping
costs. Each step is the user's: `opt.zero_grad()` (gradients set to None), forward, backward,
`opt.step()`. Per step two times: the wall time (on CUDA after a synchronize: the step) and the
host time (CPU: the calling thread's CPU time, which leaves out gloo's threads and the load of
other processes; CUDA: the wall time until the host returns from `opt.step()`, before the
synchronize, i.e. the time the host spends issuing the step). Variants take turns in a
balanced order every round; the ratios to DDP are medians of per-round ratios, with their
middle half.

    python benchmarks/probes/dp_host_cost.py                         # CPU, one rank, gloo
    python benchmarks/probes/dp_host_cost.py --world 4 --threads 3   # CPU, 4 ranks
    python3 benchmarks/probes/dp_host_cost.py --device cuda --world 1

Writes benchmarks/results/dp_host_cost_<device>_ws<N>.json and .md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _lib
from _lib.common import (add_common_args, balanced_orders, device_label, line_up, out_dir, run_ranks, world_size,
                         write_results)
from _lib.ratios import per_round, text, verdict
from overlapkit.data_parallel import DataParallel

VARIANTS = ("overlapkit DataParallel", "overlapkit overlap=False", "torch DDP", "no data parallelism")
TARGET = 1.0
"""The host cost of a step of DataParallel's defaults at most DDP's (issue target: <= DDP's)."""


def small_params_model(layers: int, width: int) -> nn.Module:
    """`layers` blocks of Linear + LayerNorm: 4 small parameters a block."""
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width)) for _ in range(layers)])


def _rank_body(device_type: str, layers: int, width: int, batch: int, rounds: int, warmup: int, threads: int,
               bucket_mb: float, budget_s: float) -> dict:
    torch.set_num_threads(threads)
    rank = dist.get_rank()
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    group = dist.group.WORLD

    def fresh():
        torch.manual_seed(0)
        return small_params_model(layers, width).to(device)

    models = {
        VARIANTS[0]: DataParallel(fresh(), group, bucket_mb=bucket_mb),
        VARIANTS[1]: DataParallel(fresh(), group, bucket_mb=bucket_mb, overlap=False),
        VARIANTS[2]: DistributedDataParallel(fresh(), process_group=group, bucket_cap_mb=bucket_mb,
                                             device_ids=[device.index] if device.type == "cuda" else None),
        VARIANTS[3]: fresh(),
    }
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(batch, width, generator=g).to(device)
    cuda = device.type == "cuda"
    clock = time.perf_counter if cuda else time.thread_time

    def step(name: str) -> tuple[float, float]:
        line_up(device)
        t0, h0 = time.perf_counter(), clock()
        opts[name].zero_grad()
        models[name](x).square().mean().backward()
        opts[name].step()
        h1 = clock()
        if cuda:
            torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) * 1e3, (h1 - h0) * 1e3

    orders = balanced_orders(len(VARIANTS))
    t0 = time.perf_counter()
    for r in range(warmup):
        for j in orders[r % len(orders)]:
            step(VARIANTS[j])
    per_round = torch.tensor([(time.perf_counter() - t0) / max(1, warmup)], dtype=torch.float64,
                             device=device if cuda else None)  # NCCL reduces only device tensors
    dist.all_reduce(per_round, op=dist.ReduceOp.MAX)  # every rank times the same number of rounds
    rounds = max(5, min(rounds, int(budget_s / max(per_round.item(), 1e-6))))
    wall: dict[str, list[float]] = {k: [] for k in VARIANTS}
    host: dict[str, list[float]] = {k: [] for k in VARIANTS}
    for r in range(rounds):
        for j in orders[r % len(orders)]:
            w, h = step(VARIANTS[j])
            wall[VARIANTS[j]].append(w)
            host[VARIANTS[j]].append(h)
    dp = models[VARIANTS[0]]
    return dict(wall=wall, host=host, rounds=rounds, params=sum(1 for _ in fresh().parameters()),
                elements=sum(p.numel() for p in fresh().parameters()), buckets=len(dp.sync.buffer.buckets))


def summarize(per_rank: list[dict]) -> dict:
    """Per variant: the slowest rank's wall and host ms per round, medians, and per-round ratios to DDP."""
    n = per_rank[0]["rounds"]
    rows = {}
    for key in ("wall", "host"):
        for name in VARIANTS:
            steps = [max(r[key][name][i] for r in per_rank) for i in range(n)]
            ddp = [max(r[key][VARIANTS[2]][i] for r in per_rank) for i in range(n)]
            row = rows.setdefault(name, {})
            row[f"{key}_ms"] = statistics.median(steps)
            row[f"{key}_vs_ddp"] = per_round(steps, ddp)
    return rows


def markdown(result: dict) -> str:
    what = "the calling thread's CPU time" if result["device"].startswith("CPU") else \
        "time to issue the step (before the synchronize)"
    head = (f"Host cost of a DP step, {result['device']}, world size {result['world']}, {result['threads']} threads a "
            f"rank, torch {result['torch']}: {result['layers']} × (Linear + LayerNorm) of width {result['width']} "
            f"({result['params']} parameters, {result['elements'] / 1e3:.0f} K elements, {result['buckets']} buckets "
            f"of at most {result['bucket_mb']:g} MiB), batch {result['batch']}. Median of {result['rounds']} "
            f"balanced-order rounds (slowest rank); host = {what}; ratios are medians of per-round ratios "
            "(middle half in brackets).\n\n")
    lines = ["| variant | step ms | vs DDP | host ms | host vs DDP |", "|---|---:|---:|---:|---:|"]
    for name, row in result["rows"].items():
        lines.append(f"| {name} | {row['wall_ms']:.3f} | {text(row['wall_vs_ddp'])} | {row['host_ms']:.3f} | "
                     f"{text(row['host_vs_ddp'])} |")
    r = result["rows"][VARIANTS[0]]["host_vs_ddp"]
    tail = (f"\nDataParallel's host cost vs DDP's: {text(r)} — target <= {TARGET:g}: {verdict(r, TARGET)}.\n")
    return head + "\n".join(lines) + "\n" + tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.set_defaults(world=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--layers", type=int, default=128, help="blocks of Linear + LayerNorm (4 parameters each)")
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="bucket cap for DataParallel and DDP alike")
    ap.add_argument("--rounds", type=int, default=200, help="timed rounds at most (see --budget-s)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=30.0, help="seconds the timed rounds may take (at least 5 rounds)")
    args = ap.parse_args(argv)
    if args.smoke:  # a few small blocks, five rounds after two
        args.layers, args.rounds, args.warmup, args.budget_s = 8, 5, 2, 1.0
    world = world_size(args)
    if world is None:
        return 2
    per_rank = run_ranks(_rank_body, world, args.device, args.layers, args.width, args.batch, args.rounds, args.warmup,
                         args.threads, args.bucket_mb, args.budget_s, device=args.device, timeout_s=600.0)
    result = dict(device=device_label(args.device), world=world, threads=args.threads, torch=torch.__version__,
                  layers=args.layers, width=args.width, batch=args.batch, bucket_mb=args.bucket_mb,
                  rounds=per_rank[0]["rounds"], params=per_rank[0]["params"], elements=per_rank[0]["elements"],
                  buckets=per_rank[0]["buckets"], rows=summarize(per_rank))
    write_results(result, os.path.join(out_dir(args), f"dp_host_cost_{args.device}_ws{world}"), markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
