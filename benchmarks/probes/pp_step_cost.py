"""What a pipeline step costs beyond its schedule's compute, overlapkit's 1F1B (whole backward and split_backward)
beside torch's Schedule1F1B on the same chunks of the same GPT: per step and rank, the collectives and
point-to-point calls issued (batch_isend_irecv, isend, irecv, all_gather, all_gather_object, barrier), the Python
function calls (sys.setprofile), and one micro-batch's chunk forward under split_backward against the plain forward
(the forward must run at the plain forward's speed). Step times alternate the variants in a balanced order; ratios
are per round (median and middle half). On a shared machine the step times are load, not a claim; the counts are.

    python benchmarks/probes/pp_step_cost.py --world 2            # 2 cores: the counts and a rough time
    python benchmarks/probes/pp_step_cost.py --world 4 --threads 3 --steps 60    # the 16-core host

Writes benchmarks/results/pp_step_cost_cpu_ws<pp>.json and .md.
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import time
from collections import Counter

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _lib
from _lib.common import balanced_orders, device_label, out_dir, pipeline_args, run_ranks, write_results
from _lib.presets import SMOKE_GPT
from _lib.ratios import per_round, text
from overlapkit import ParallelGroups
from overlapkit.models import GPT, GPTConfig, gpt_chunks, lm_loss
from overlapkit.pipeline_parallel import PipelineConfig, PipelineEngine

GPT_16 = dict(vocab_size=1024, seq_len=64, hidden=256, num_heads=4, ffn_hidden=1024)
"""pp_overlap.py's GPT (its layers 2 · pp)."""
COUNTED = ("batch_isend_irecv", "isend", "irecv", "all_gather", "all_gather_object", "all_reduce", "barrier")
OURS, SPLIT, TORCH = "overlapkit 1f1b", "overlapkit 1f1b split_backward", "torch Schedule1F1B"


def _counting(calls: Counter, who: list):
    """Wrap torch.distributed's entry points so that each call is counted under the variant running."""
    import torch.distributed.distributed_c10d as c10d

    for name in COUNTED:
        real = getattr(dist, name)

        def call(*a, _real=real, _name=name, **k):
            calls[(who[0], _name)] += 1
            return _real(*a, **k)
        setattr(dist, name, call)
        setattr(c10d, name, call)


def _python_calls(fn) -> int:
    n = [0]

    def count(_frame, event, _arg):
        if event == "call":
            n[0] += 1
    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n[0]


def _forward_ms(engine: PipelineEngine, x: torch.Tensor, reps: int) -> dict:
    """One chunk forward (with grad) plain and as a split F routes it: median ms of alternated calls."""
    from _lib.unexported import LinearRouter, WeightGradStore, split_linears

    chunk = engine.chunks[0]
    router = LinearRouter([chunk])
    times = {"plain": [], "split": []}
    for _ in range(reps):
        for k in times:
            t0 = time.perf_counter()
            if k == "plain":
                chunk(x)
            else:
                with split_linears(router, WeightGradStore()):
                    chunk(x)
            times[k].append((time.perf_counter() - t0) * 1e3)
    return dict(times=times, ratio=per_round(times["split"], times["plain"]))


def _rank_body(gpt: dict, m: int, rows: int, steps: int, warmup: int, threads: int) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.set_num_threads(threads)
    groups = ParallelGroups.build(pp=dist.get_world_size())
    pp, rank = groups.sizes.pp, groups.pp_rank
    cfg = GPTConfig(**gpt)
    torch.manual_seed(0)
    base = GPT(cfg)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (m * rows, cfg.seq_len), generator=g)
    tgt = torch.randint(0, cfg.vocab_size, (m * rows, cfg.seq_len), generator=g)
    first, last = rank == 0, rank == pp - 1
    runs, engines = {}, {}
    for name, split in ((OURS, False), (SPLIT, True)):
        chunks, _ = gpt_chunks(copy.deepcopy(base), pp, rank, 1)
        engines[name] = PipelineEngine(chunks, groups.pp, PipelineConfig("1f1b", m, 1, split_backward=split), lm_loss)
        runs[name] = lambda e=engines[name]: e.step(idx if first else None, tgt if last else None)
    chunks, _ = gpt_chunks(copy.deepcopy(base), pp, rank, 1)
    sched = Schedule1F1B(PipelineStage(chunks[0], rank, pp, torch.device("cpu"), group=groups.pp), m, loss_fn=lm_loss)
    runs[TORCH] = lambda: sched.step(*([idx] if first else []), **(dict(target=tgt, losses=[]) if last else {}))

    calls: Counter = Counter()
    who = ["warm-up"]
    _counting(calls, who)
    names = list(runs)
    orders = balanced_orders(len(names))
    times: dict[str, list[float]] = {n: [] for n in names}
    python: dict[str, int] = {}
    for i in range(warmup + steps):
        for n in (names[j] for j in orders[i % len(orders)]):
            dist.barrier()
            who[0] = n if i == warmup else "timed"  # the first step after the warm-up is the one counted
            t0 = time.perf_counter()
            runs[n]()
            if i >= warmup:
                times[n].append((time.perf_counter() - t0) * 1e3)
            who[0] = "between"
    for n in names:  # one more step each, its Python calls counted (slower under the profile hook: not timed)
        dist.barrier()
        python[n] = _python_calls(runs[n])
    for n in names:  # a step takes as long as its slowest rank
        t = torch.tensor(times[n], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times[n] = t.tolist()
    x = torch.randn(rows, cfg.seq_len, cfg.hidden, requires_grad=True)
    fwd = _forward_ms(engines[OURS], x, max(5, steps)) if rank > 0 else None  # a chunk that takes activations
    counts = {n: {c: calls[(n, c)] for c in COUNTED if calls[(n, c)]} for n in names}
    return dict(times=times, counts=counts, python=python, forward=fwd)


def summarize(per_rank: list[dict]) -> dict:
    t = per_rank[0]["times"]
    rows = {n: dict(step_ms=statistics.median(v), vs_torch=per_round(v, t[TORCH]),
                    counts=[r["counts"][n] for r in per_rank], python_calls=[r["python"][n] for r in per_rank])
            for n, v in t.items()}
    fwd = next((r["forward"] for r in per_rank if r["forward"]), None)
    return dict(rows=rows, forward=None if fwd is None else dict(
        plain_ms=statistics.median(fwd["times"]["plain"]), split_ms=statistics.median(fwd["times"]["split"]),
        ratio=fwd["ratio"]))


def markdown(r: dict) -> str:
    head = (f"PP step cost beyond compute, {r['device']}, pp={r['world']}, {r['threads']} thread(s) a rank, torch "
            f"{r['torch']}: GPT hidden {r['gpt']['hidden']}, {r['gpt']['num_layers']} layers, m={r['microbatches']} "
            f"micro-batches of {r['mb_rows']} rows; {r['steps']} balanced-order rounds (slowest rank). Calls: one step, "
            "per rank; torch.distributed calls as issued from Python (a batch_isend_irecv's P2POps name isend and "
            "irecv, counted too). Python calls: every function call of one step (sys.setprofile).\n\n")
    lines = ["| variant | step ms | vs torch (per round) | distributed calls a step (rank 0; last rank) | "
             "Python calls a step (rank 0; last rank) |", "|---|---:|---|---|---|"]
    for n, row in r["rows"].items():
        c = row["counts"]
        lines.append(f"| {n} | {row['step_ms']:.2f} | {text(row['vs_torch'])} | {c[0]}; {c[-1]} | "
                     f"{row['python_calls'][0]}; {row['python_calls'][-1]} |")
    f = r["forward"]
    tail = "" if f is None else (
        f"\n\nOne chunk forward (rank 1's, with grad), alternated: plain {f['plain_ms']:.3f} ms, as split_backward's F "
        f"runs it {f['split_ms']:.3f} ms; per call {text(f['ratio'])}.\n")
    return head + "\n".join(lines) + tail


def main(argv: list[str] | None = None) -> int:
    ap = pipeline_args(__doc__.split("\n\n")[0])
    args = ap.parse_args(argv)
    if args.device != "cpu":
        print("pp_step_cost: pipeline stages need one GPU each; run it on the CPU with gloo (--device cpu)",
              file=sys.stderr)
        return 2
    if args.smoke:
        args.steps, args.warmup = 2, 1
    pp = args.world or 2
    m = args.microbatches or 2 * pp
    gpt = dict(SMOKE_GPT if args.smoke else GPT_16, num_layers=2 * pp)
    mb_rows = 2
    per_rank = run_ranks(_rank_body, pp, gpt, m, mb_rows, args.steps, args.warmup, args.threads, timeout_s=600.0)
    result = dict(device=device_label("cpu"), world=pp, threads=args.threads, torch=torch.__version__, gpt=gpt,
                  microbatches=m, mb_rows=mb_rows, steps=args.steps, **summarize(per_rank))
    write_results(result, os.path.join(out_dir(args), f"pp_step_cost_cpu_ws{pp}"), markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
