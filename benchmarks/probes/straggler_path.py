"""Does the critical path find a straggler, and does "rank k at the median" predict the step without it?

N gloo ranks train a small MLP with plain PyTorch DDP (or `--engine overlapkit`, overlapkit's
DataParallel), one thread per rank, profiled with torch.profiler, three cycles in one run:
without a straggler, with rank k sleeping d ms before its forward every step, and without again.
Each cycle's traces (one per rank) are analyzed as `overlapkit analyze DIR` does; reported:

- the step as its critical path explains it, with and without the straggler (the two cycles
  without are averaged, so drift over the run cancels);
- which rank the path waits for most ("waiting for rank k" segments) and the top what-if;
- the what-if "rank k as fast as the median of the others" on the cycle with the straggler,
  against the step measured without it: the error, target within 5 % (also on wall-clock steps).
  With two ranks the "median of the others" is the other rank, whose own jitter sets the step without
  the straggler: a 2-rank smoke run checks that it runs, not the target.

    python benchmarks/probes/straggler_path.py --smoke     # 2 ranks, MLP 2x64, 3 steps, 20 ms: runs, checks nothing
    python benchmarks/probes/straggler_path.py --world 16 --straggler 5 --sleep-ms 30                      # 16 cores

Writes benchmarks/results/straggler_path_cpu{N}.json and .md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _lib
from _lib.common import add_out_arg, add_smoke_arg, out_dir, run_ranks, write_results
from _lib.unexported import whatif
from overlapkit.timeline import analyze, read_traces

CYCLES = ("without_a", "with", "without_b")


def _rank(folder: str, engine: str, hidden: int, layers: int, batch: int, steps: int, straggler: int,
          sleep_ms: float, stall: str) -> dict:
    from torch.profiler import ProfilerActivity, profile, schedule

    torch.set_num_threads(1)
    torch.manual_seed(0)
    rank = dist.get_rank()
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU())
                                  for _ in range(layers)])
    if engine == "overlapkit":
        from overlapkit.data_parallel import DataParallel

        model = DataParallel(model, dist.group.WORLD, bucket_mb=1.0)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, hidden)

    def step(sleep: bool) -> None:
        if sleep and stall == "sleep":
            time.sleep(sleep_ms / 1e3)
        elif sleep:  # spin: the late rank holds its core, as slow compute would
            until = time.perf_counter() + sleep_ms / 1e3
            while time.perf_counter() < until:
                pass
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    for _ in range(3):
        step(False)
    wall = {}
    for cycle in CYCLES:
        os.makedirs(f"{folder}/{cycle}", exist_ok=True)
        path = f"{folder}/{cycle}/rank{rank}.pt.trace.json"
        times = []
        # one warm-up step, `steps` kept, one more that the analyzer leaves out (the profiler stops in it)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                     schedule=schedule(wait=0, warmup=1, active=steps + 1, repeat=1),
                     on_trace_ready=lambda p, path=path: p.export_chrome_trace(path)) as prof:
            for _ in range(steps + 2):
                t0 = time.perf_counter()
                step(cycle == "with" and rank == straggler)
                times.append((time.perf_counter() - t0) * 1e3)
                prof.step()
        dist.barrier()
        wall[cycle] = statistics.median(times[1:-1])
    return wall


def _cycle(folder: str) -> dict:
    traces = read_traces([folder])
    a = analyze(traces)
    waited: dict[int, float] = {}
    for p in a.paths:
        for s in p.segments:
            if s.why.startswith("waiting for rank"):
                waited[s.rank] = waited.get(s.rank, 0.0) + s.ms / len(a.paths)
    return dict(analysis=a, path_ms=whatif.measured_ms(a.paths),
                window_ms=statistics.mean(p.window_ms for p in a.paths), waited=waited,
                top=a.what_if[0]["question"] if a.what_if else None,
                coverage=statistics.mean(p.path_ms / p.window_ms for p in a.paths))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--engine", choices=("ddp", "overlapkit"), default="ddp")
    ap.add_argument("--straggler", type=int, default=None, help="the sleeping rank (default: the last)")
    ap.add_argument("--sleep-ms", type=float, default=30.0)
    ap.add_argument("--stall", choices=("sleep", "spin"), default="sleep",
                    help="how the late rank is late: sleeping frees its core for the others (on an oversubscribed "
                         "machine that speeds them up), spinning holds it as slow compute would")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--keep", help="keep the traces in this folder (default: a temporary one)")
    add_out_arg(ap)
    add_smoke_arg(ap)
    args = ap.parse_args()
    if args.smoke:
        args.world, args.hidden, args.layers, args.steps, args.sleep_ms = 2, 64, 2, 3, 20.0
    k = args.world - 1 if args.straggler is None else args.straggler
    folder = args.keep or tempfile.mkdtemp(prefix="straggler_path_")
    walls = run_ranks(_rank, args.world, folder, args.engine, args.hidden, args.layers, args.batch, args.steps, k,
                      args.sleep_ms, args.stall, timeout_s=args.timeout)
    cycles = {c: _cycle(os.path.join(folder, c)) for c in CYCLES}
    without = statistics.mean(cycles[c]["path_ms"] for c in ("without_a", "without_b"))
    slow = cycles["with"]
    saving = whatif.rank_at_median(slow["analysis"].paths, k)
    predicted = slow["path_ms"] - saving
    named = max(slow["waited"], key=slow["waited"].get) if slow["waited"] else None
    wall = {c: statistics.mean(w[c] for w in walls) for c in CYCLES}
    result = dict(
        world=args.world, engine=args.engine, straggler=k, sleep_ms=args.sleep_ms, stall=args.stall, hidden=args.hidden,
        layers=args.layers, batch=args.batch, steps=args.steps, torch=torch.__version__,
        step_without_ms=without, step_with_ms=slow["path_ms"], predicted_without_ms=predicted,
        error_pct=100 * (predicted - without) / without, path_names_rank=named, named_ok=named == k,
        saving_ms=saving,
        wall_error_pct=100 * (statistics.mean(w["with"] for w in walls) - saving
                              - statistics.mean((w["without_a"] + w["without_b"]) / 2 for w in walls))
        / statistics.mean((w["without_a"] + w["without_b"]) / 2 for w in walls),
        waited_for_ms=slow["waited"], top_what_if=slow["top"],
        coverage=min(c["coverage"] for c in cycles.values()),
        wall_step_ms=wall, steps_analyzed={c: len(v["analysis"].paths) for c, v in cycles.items()},
        traces=folder if args.keep else None)
    for c in cycles.values():
        c.pop("analysis")
    if not args.keep:
        shutil.rmtree(folder, ignore_errors=True)
    write_results(result, os.path.join(out_dir(args), f"straggler_path_cpu{args.world}"), _markdown)
    ok = result["named_ok"] and abs(result["error_pct"]) <= 5.0
    print(("within target" if ok else "MISSED the target") + f": path names rank {named} (straggler {k}), "
          f"predicted {predicted:.1f} ms vs measured {without:.1f} ms without it ({result['error_pct']:+.1f} %)",
          file=sys.stderr)


def _markdown(r: dict) -> str:
    return "\n".join([
        f"Straggler on the critical path: {r['world']} gloo ranks, {r['engine']}, rank {r['straggler']} "
        f"{'sleeps' if r['stall'] == 'sleep' else 'spins'} {r['sleep_ms']:g} ms per step (MLP {r['layers']}x{r['hidden']}, batch {r['batch']}, torch {r['torch']})",
        "",
        "| step without ms | step with ms | 'rank k at the median' predicts ms | error % | same on wall-clock steps, error % | saves ms | path waits most for | top what-if | path / step (min) |",
        "|---:|---:|---:|---:|---:|---:|---|---|---:|",
        f"| {r['step_without_ms']:.2f} | {r['step_with_ms']:.2f} | {r['predicted_without_ms']:.2f} | "
        f"{r['error_pct']:+.1f} | {r['wall_error_pct']:+.1f} | {r['saving_ms']:.2f} | rank {r['path_names_rank']} | "
        f"{r['top_what_if']} | {r['coverage']:.3f} |",
        "",
        "Steps are the critical path's (each step's window across ranks, on the aligned clock); the wall-clock "
        "error applies the same saving to the ranks' measured step times.",
        "",
        "Wall-clock step (median per rank, mean over ranks), ms: "
        + ", ".join(f"{c} {v:.2f}" for c, v in r["wall_step_ms"].items()), ""])


if __name__ == "__main__":
    main()
