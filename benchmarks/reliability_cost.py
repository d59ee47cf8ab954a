"""What the data-parallel engines' guards cost a step: the model-change watch and the parameter-gather guard.

Two guards run on every step of DataParallel / ShardedOptimizer / fully_shard:
- the watch (data_parallel/watch.py): at each forward, one (dtype, device, requires_grad) tuple per
  parameter compared with the one taken at wrapping (registration hooks flag added parameters);
- the gather guard (data_parallel/zero_guard.py), under ShardedOptimizer(overlap_param_gather=True):
  after step() each in-flight bucket's parameters switch class to one whose torch functions wait for
  the bucket, and back once it lands; a read before landing pays a __torch_function__ call.

Each is timed alone (host microseconds, median of repeats) for models of 64 to 4096 parameters and
set beside the host time of one DataParallel forward+backward of the same model on one rank (the
step the watch runs in), so the share is an upper bound for any larger step.

    python benchmarks/reliability_cost.py            # CPU, one process, ~20 s
    python benchmarks/reliability_cost.py --smoke    # a few seconds, results to a temporary folder
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from _lib.common import add_out_arg, add_smoke_arg, init_one_rank, out_dir, write_results  # noqa: E402


def _median_us(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _model(n_params: int, width: int) -> nn.Module:
    # Linear layers with a bias: two parameters each; a small width keeps the step host-bound, the worst case.
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(n_params // 2)])


def _measure(n_params: int, width: int, reps: int) -> dict:
    import torch.distributed as dist

    from _lib.unexported import ParamWatch, guard, release
    from overlapkit.data_parallel import DataParallel

    model = _model(n_params, width)
    dp = DataParallel(model, dist.group.WORLD)
    x = torch.randn(4, width)

    def step():
        dp(x).sum().backward()
        for p in model.parameters():
            p.grad = None

    for _ in range(3):
        step()
    step_us = _median_us(step, max(5, reps // 20))
    watch = ParamWatch(model, "bench", "")
    watch_us = _median_us(watch.problem, reps)
    params = list(model.parameters())
    landed = []

    def guard_and_release():
        guard(params, lambda: landed.append(1))
        release(params)

    swap_us = _median_us(guard_and_release, reps)
    p = params[0]
    plain_read = _median_us(lambda: p.mul(1.0), reps)
    guard([p], lambda: None)
    guarded_read = _median_us(lambda: p.mul(1.0), reps)
    release([p])
    return dict(params=n_params, step_us=step_us, watch_us=watch_us, watch_share=watch_us / step_us,
                guard_release_us=swap_us, guard_share=swap_us / step_us,
                read_plain_us=plain_read, read_guarded_us=guarded_read)


def _markdown(result: dict) -> str:
    lines = [f"Host cost of the data-parallel guards, one process, {result['device']}, torch {result['torch']}; "
             "step = one DataParallel forward+backward of Linear({w},{w}) layers (host-bound: the worst case for "
             "the share)".format(w=result["width"]), "",
             "| parameters | step µs | watch µs (share) | guard+release µs (share) | read µs plain / guarded |",
             "|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['params']} | {r['step_us']:.0f} | {r['watch_us']:.1f} ({100 * r['watch_share']:.2f} %) | "
                     f"{r['guard_release_us']:.1f} ({100 * r['guard_share']:.2f} %) | "
                     f"{r['read_plain_us']:.2f} / {r['read_guarded_us']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--entry" in argv:  # the per-forward entry checks' share of a training step (_lib/entry_cost.py)
        from _lib.entry_cost import main as entry_main
        return entry_main([a for a in argv if a != "--entry"])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, nargs="+", default=[64, 512, 4096])
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--reps", type=int, default=200)
    add_out_arg(ap)
    add_smoke_arg(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.params, args.reps = [8, 32], 5
    import torch.distributed as dist

    init_one_rank()
    try:
        torch.set_num_threads(1)
        rows = [_measure(n, args.width, args.reps) for n in args.params]
    finally:
        dist.destroy_process_group()
    write_results(dict(device="CPU", torch=torch.__version__, width=args.width, rows=rows),
                  os.path.join(out_dir(args), "reliability_cost_cpu"), _markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
