"""Zero-bubble and DualPipeV pipeline schedules, side by side in one run: overlapkit 1F1B, interleaved
1F1B, ZB-H1 (zb1p), ZB-V (zbv) and DualPipeV, and torch.distributed.pipelining's Schedule1F1B,
ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble (ZB-H1 with one stage a rank),
ScheduleZBVZeroBubble and ScheduleDualPipeV (those this torch has) on the same chunks of the same GPT.

Measured: step time (slowest rank, median; variants take turns in a balanced order, _lib.common.time_variants);
the bubble (the recorder's waits for a neighbour that had not sent, plus the drain) over compute,
from recorded steps; the peak of the bytes a step allocates (torch.profiler's CPU memory events, the
rank that allocates most); exactness of each of ours against torch's same schedule (loss and every
gradient, fp32). A second run puts a MoE in every block (experts over ep ranks, each stage's dp
ranks) and measures, for DualPipeV with its pairs overlapped and not, the share of the all-to-all
time no compute covered.

    python benchmarks/probes/pp_zero_bubble.py --smoke                                  # tiny sizes, one step each
    python benchmarks/probes/pp_zero_bubble.py --world 4 --threads 4 --steps 30         # the 16-core host: pp=4

Writes benchmarks/results/pp_zero_bubble_cpu_ws<pp>.json and .md.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _lib
from _lib.common import device_label, line_up, out_dir, pipeline_args, run_ranks, time_variants, write_results
from _lib.unexported import intervals as iv
from overlapkit import ParallelGroups
from overlapkit.models import GPT, GPTConfig, gpt_chunks, lm_loss
from overlapkit.pipeline_parallel import PipelineConfig, PipelineEngine, chunks_of, pipeline_times, placement, rank_of
from overlapkit.timeline import record

_TORCH_V_BROKEN = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)
"""torch < 2.13's V-shaped schedules send between one rank's own two stages over gloo, which gloo
refuses ("Pair is not connected", seen with 2.11 on the 16-core host): not compared there."""

OURS = [("1f1b", 1), ("interleaved-1f1b", 2), ("zb1p", 1), ("zbv", 2), ("dualpipev", 2)]
TORCH = {"1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B", "zb1p": "ScheduleInterleavedZeroBubble",
         "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
PRESETS = {"cpu16": dict(gpt=dict(vocab_size=1024, seq_len=64, hidden=256, num_heads=4, ffn_hidden=1024), mb_rows=2,
                         moe=dict(hidden=128, ffn_hidden=256, seq_len=64, mb_rows=4)),
           "tiny": dict(gpt=dict(vocab_size=64, seq_len=16, hidden=32, num_heads=2, ffn_hidden=64), mb_rows=2,
                        moe=dict(hidden=16, ffn_hidden=32, seq_len=8, mb_rows=2))}


def _ours(s: str) -> str:
    return f"overlapkit {s}"


def _theirs(s: str) -> str:
    return f"torch {TORCH[s]}"


def _peak_alloc(fn) -> int:
    """Bytes allocated at the peak of one call (above what was allocated when it started): CPU memory events."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    path = tempfile.mktemp(suffix=".json")
    prof.export_chrome_trace(path)
    try:
        events = json.load(open(path))["traceEvents"]
    finally:
        os.unlink(path)
    return max([e["args"].get("Total Allocated", 0) for e in events if e.get("name") == "[memory]"] or [0])


def _calibrate(groups, base, idx, tgt, m: int) -> tuple[float, float, float]:
    """Mean F, B and W of a chunk over every rank (zb1p, one recorded step): what zbv's order is built for."""
    chunks, _ = gpt_chunks(copy.deepcopy(base), groups.sizes.pp, groups.pp_rank, 1)
    engine = PipelineEngine(chunks, groups.pp, PipelineConfig("zb1p", m), lm_loss)
    first, last = groups.pp_rank == 0, groups.pp_rank == groups.sizes.pp - 1
    engine.step(idx if first else None, tgt if last else None)
    with record():
        engine.step(idx if first else None, tgt if last else None)
    sums = torch.zeros(3)
    for op, _, _, a, b in engine.timings[0].actions:
        sums["FBW".index(op)] += b - a
    dist.all_reduce(sums, group=groups.pp)
    return tuple((sums / sums[0]).tolist())


def _dense_body(preset: dict, steps: int, warmup: int, recorded: int, threads: int) -> dict:
    import torch.distributed.pipelining as pipelining

    torch.set_num_threads(threads)
    groups = ParallelGroups.build(pp=dist.get_world_size())
    pp, rank, m = groups.sizes.pp, groups.pp_rank, preset["microbatches"]
    cfg = GPTConfig(num_layers=4 * pp, **preset["gpt"])
    torch.manual_seed(0)
    base = GPT(cfg)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (m * preset["mb_rows"], cfg.seq_len), generator=g)
    tgt = torch.randint(0, cfg.vocab_size, (m * preset["mb_rows"], cfg.seq_len), generator=g)
    costs = _calibrate(groups, base, idx, tgt, m)
    runs, engines, missing = {}, {}, []
    for s, v in OURS:
        style = placement(s)
        first, last = rank == 0, rank == rank_of(pp * v - 1, pp, style)
        chunks, _ = gpt_chunks(copy.deepcopy(base), pp, rank, v, style=style)
        engine = engines[_ours(s)] = PipelineEngine(chunks, groups.pp, PipelineConfig(s, m, v, costs=costs), lm_loss)
        runs[_ours(s)] = (lambda e=engine, f=first, la=last: e.step(idx if f else None, tgt if la else None), chunks)
        cls = getattr(pipelining, TORCH[s], None)
        if cls is None or (v > 1 and style == "v" and _TORCH_V_BROKEN):
            missing.append(TORCH[s])
            continue
        theirs, _ = gpt_chunks(copy.deepcopy(base), pp, rank, v, style=style)
        stages = [pipelining.PipelineStage(c, k, pp * v, torch.device("cpu"), group=groups.pp)
                  for k, c in zip(chunks_of(rank, pp, v, style), theirs)]
        sched = cls(stages[0] if s == "1f1b" else stages, m, loss_fn=lm_loss)

        def run(sched=sched, f=first, la=last):
            out = []
            sched.step(*([idx] if f else []), **(dict(target=tgt, losses=out) if la else {}))
            return torch.stack(out).sum() / m if la else None  # torch's mean-reduced losses, summed as ours
        runs[_theirs(s)] = (run, theirs)
    exact = _exactness(runs)
    names = list(runs)

    def step(name: str) -> None:
        fn, chunks = runs[name]
        for c in chunks:
            c.zero_grad(set_to_none=False)
        fn()
    times = time_variants(step, names, steps, warmup, torch.device("cpu"))
    peak = {}
    for name in names:
        line_up(torch.device("cpu"))
        peak[name] = _peak_alloc(runs[name][0])
    with record() as rec:
        for _ in range(recorded):
            for name in engines:
                line_up(torch.device("cpu"))
                rec.next_step()
                runs[name][0]()
    recs = {name: [asdict(pipeline_times(rec.spans, t)) | {"kept_w_peak_bytes": t.kept_w_peak_bytes}
                   for t in e.timings] for name, e in engines.items()}
    return dict(times=times, recorded=recs, peak=peak, exact=exact, missing=missing, costs=costs,
                params=sum(p.numel() for p in base.parameters()), layers=cfg.num_layers)


def _exactness(runs: dict) -> dict:
    """Per schedule: the worst relative error between ours and torch's (loss and every gradient), one step."""
    got = {}
    for name, (fn, chunks) in runs.items():
        for c in chunks:
            c.zero_grad(set_to_none=True)
        loss = fn()
        got[name] = (loss, {n: p.grad.clone() for c in chunks for n, p in c.named_parameters()})
    out = {}
    rel = lambda a, b: ((a - b).norm() / b.norm().clamp_min(1e-30)).item()  # noqa: E731
    for s, _ in OURS:
        if _theirs(s) not in got:
            continue
        (la, ga), (lb, gb) = got[_ours(s)], got[_theirs(s)]
        errs = [rel(ga[n], gb[n]) for n in ga] + ([rel(la, lb)] if la is not None and lb is not None else [])
        out[s] = max(errs)
    return out


def _moe_body(preset: dict, ep: int, steps: int, recorded: int, threads: int) -> dict:
    """pp x ep ranks, a MoE in every block: DualPipeV with pairs overlapped and not, and zb1p, timed and recorded."""
    from overlapkit.expert_parallel import MoE

    torch.set_num_threads(threads)
    pp = dist.get_world_size() // ep
    groups = ParallelGroups.build(pp=pp, dp=ep, ep=ep)
    rank, m, mp = groups.pp_rank, preset["microbatches"], preset["moe"]
    cfg = GPTConfig(vocab_size=preset["gpt"]["vocab_size"], seq_len=mp["seq_len"], hidden=mp["hidden"],
                    num_heads=2, ffn_hidden=mp["ffn_hidden"], num_layers=4 * pp)
    def model():  # built anew for each variant: a MoE holds its process group, which does not deep-copy
        torch.manual_seed(0)
        return GPT(cfg, moe_every=1, moe=lambda i: MoE(cfg.hidden, cfg.ffn_hidden, 2 * ep, 2, groups, name=f"moe{i}"))
    g = torch.Generator().manual_seed(groups.dp_rank)
    idx = torch.randint(0, cfg.vocab_size, (m * mp["mb_rows"], cfg.seq_len), generator=g)
    variants = {"dualpipev, pairs overlapped": ("dualpipev", 2, True), "dualpipev, pairs in turn": ("dualpipev", 2, False),
                "zb1p": ("zb1p", 1, True)}
    out = {}
    for name, (s, v, pairs) in variants.items():
        style = placement(s)
        chunks, _ = gpt_chunks(model(), pp, rank, v, style=style)
        engine = PipelineEngine(chunks, groups.pp, PipelineConfig(s, m, v, overlap_pairs=pairs), lm_loss)
        first, last = rank == 0, rank == rank_of(pp * v - 1, pp, style)
        step = lambda e=engine, f=first, la=last: e.step(idx if f else None, idx if la else None)  # noqa: E731
        step()
        ts = []
        for _ in range(steps):
            line_up(torch.device("cpu"))
            t0 = time.perf_counter()
            step()
            ts.append((time.perf_counter() - t0) * 1e3)
        with record() as rec:
            for _ in range(recorded):
                line_up(torch.device("cpu"))
                step()
                rec.next_step()
        fractions = []
        for k in range(recorded):
            spans = [s_ for s_ in rec.spans if s_.step == k]
            a2a = iv.union((x.start_ms, x.end_ms) for x in spans if x.kind in ("ep_dispatch", "ep_combine"))
            compute = iv.union((x.start_ms, x.end_ms) for x in spans if x.is_compute)
            total = iv.length(a2a)
            fractions.append(iv.length(iv.subtract(a2a, compute)) / total if total else 0.0)
        out[name] = dict(times=ts, exposed_a2a=fractions)
    return out


def _median(xs):
    return statistics.median(xs) if xs else None


def summarize(per_rank: list[dict], moe: list[dict] | None) -> dict:
    names = list(per_rank[0]["times"])
    steps = {n: [max(r["times"][n][i] for r in per_rank) for i in range(len(per_rank[0]["times"][n]))] for n in names}
    rows = {}
    for n in names:
        row = rows[n] = {"step_ms": _median(steps[n]), "peak_mib": max(r["peak"][n] for r in per_rank) / 2**20,
                         "peak_mib_per_rank": [r["peak"][n] / 2**20 for r in per_rank]}
        row["vs_ours_1f1b"] = _median([a / b for a, b in zip(steps[n], steps[_ours("1f1b")])])
        s = next(s for s, _ in OURS if n in (_ours(s), _theirs(s)))
        if n == _ours(s) and _theirs(s) in steps:
            row["vs_torch_same"] = _median([a / b for a, b in zip(steps[n], steps[_theirs(s)])])
            row["exact_vs_torch"] = max(r["exact"][s] for r in per_rank)
        recs = [t for r in per_rank for t in r["recorded"].get(n, [])]
        if recs:
            row["bubble_fraction"] = _median([t["bubble_ms"] / t["compute_ms"] for t in recs if t["compute_ms"] > 0])
            row["kept_w_mib"] = max(t["kept_w_peak_bytes"] for t in recs) / 2**20
    for s in ("zb1p", "zbv", "dualpipev"):
        rows[_ours(s)]["bubble_vs_1f1b"] = rows[_ours(s)]["bubble_fraction"] / rows[_ours("1f1b")]["bubble_fraction"]
    moe_rows = {}
    if moe:
        for n in moe[0]:
            moe_rows[n] = {"step_ms": _median([max(r[n]["times"][i] for r in moe) for i in range(len(moe[0][n]["times"]))]),
                           "exposed_a2a": _median([f for r in moe for f in r[n]["exposed_a2a"]])}
    return {"rows": rows, "moe": moe_rows}


def misses(summary: dict) -> list[str]:
    rows, out = summary["rows"], []
    limits = {"zb1p": 0.5, "zbv": 0.2, "dualpipev": 0.2}
    for s, limit in limits.items():
        r = rows[_ours(s)]
        if r["bubble_vs_1f1b"] > limit:
            out.append(f"{s}: bubble {r['bubble_vs_1f1b']:.2f}x overlapkit 1F1B's (target <= {limit})")
        if r["vs_ours_1f1b"] > 0.9:
            out.append(f"{s}: step {r['vs_ours_1f1b']:.3f}x overlapkit 1F1B's (target <= 0.9)")
        if r.get("vs_torch_same") is not None and r["vs_torch_same"] > 0.97:
            out.append(f"{s}: step {r['vs_torch_same']:.3f}x torch {TORCH[s]}'s (target <= 0.97)")
        if r.get("exact_vs_torch") is not None and r["exact_vs_torch"] > 1e-5:
            out.append(f"{s}: differs from torch {TORCH[s]} by {r['exact_vs_torch']:.1e} (target <= 1e-5)")
    zb, one = rows[_ours("zb1p")]["peak_mib"], rows[_ours("1f1b")]["peak_mib"]
    if abs(zb / one - 1) > 0.1:
        out.append(f"zb1p: peak allocation {zb:.2f} MiB, {zb / one:.2f}x 1F1B's {one:.2f} MiB (target: within 10 %)")
    moe = summary["moe"].get("dualpipev, pairs overlapped")
    if moe and moe["exposed_a2a"] > 0.3:
        out.append(f"dualpipev with MoE: {100 * moe['exposed_a2a']:.0f} % of all-to-all time exposed (target <= 30 %)")
    return out


def markdown(result: dict) -> str:
    fmt = lambda v, spec: "—" if v is None else format(v, spec)  # noqa: E731
    p = result["preset"]
    head = (f"Zero-bubble / DualPipeV pipeline schedules, {result['device']}, pp={result['world']}, {result['threads']} "
            f"thread(s) a rank, torch {result['torch']}: GPT {result['params'] / 1e6:.2f} M parameters, "
            f"{result['layers']} layers, m={p['microbatches']} micro-batches of {p['mb_rows']} rows; zbv's order built "
            f"for measured chunk costs F:B:W = {':'.join(f'{c:.2f}' for c in result['costs'])}. Median of "
            f"{result['steps']} steps (slowest rank); bubble from recorded steps; peak = the most bytes a step "
            f"allocates, on the rank that allocates most. Not in this torch: {', '.join(result['missing']) or 'none'}.\n\n")
    lines = ["| variant | step ms | vs our 1F1B | vs torch's same | bubble / compute | bubble vs our 1F1B's "
             "| peak MiB | kept W MiB | max rel err vs torch |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n, r in result["rows"].items():
        lines.append(f"| {n} | {r['step_ms']:.2f} | {r['vs_ours_1f1b']:.3f} | {fmt(r.get('vs_torch_same'), '.3f')} "
                     f"| {fmt(r.get('bubble_fraction'), '.3f')} | {fmt(r.get('bubble_vs_1f1b'), '.2f')} "
                     f"| {r['peak_mib']:.2f} | {fmt(r.get('kept_w_mib'), '.2f')} | {fmt(r.get('exact_vs_torch'), '.1e')} |")
    if result["moe"]:
        lines += ["", f"MoE in every block, experts over ep={result['ep']} (pp={result['world']} x ep ranks):", "",
                  "| variant | step ms | all-to-all exposed |", "|---|---:|---:|"]
        lines += [f"| {n} | {r['step_ms']:.2f} | {100 * r['exposed_a2a']:.0f} % |" for n, r in result["moe"].items()]
    tail = "\n\nMisses: " + ("; ".join(result["misses"]) if result["misses"] else "none") + "\n"
    return head + "\n".join(lines) + tail


def main(argv: list[str] | None = None) -> int:
    ap = pipeline_args(__doc__.split("\n\n")[0])
    ap.add_argument("--ep", type=int, default=2, help="expert-parallel ranks per stage in the MoE run (0: skip it)")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (a smoke run)")
    args = ap.parse_args(argv)
    if args.smoke:  # the tiny sizes, one step after one, one recorded
        args.tiny, args.steps, args.warmup, args.recorded = True, 1, 1, 1
    if args.device != "cpu":
        print("pp_zero_bubble: pipeline stages need one GPU each; run it on the CPU with gloo (--device cpu)",
              file=sys.stderr)
        return 2
    pp = args.world or 2
    preset = copy.deepcopy(PRESETS["tiny" if args.tiny else "cpu16"])
    preset["microbatches"] = args.microbatches or 2 * pp
    per_rank = run_ranks(_dense_body, pp, preset, args.steps, args.warmup, args.recorded, args.threads,
                         timeout_s=600.0)
    moe = None
    if args.ep > 0:
        moe = run_ranks(_moe_body, pp * args.ep, preset, args.ep, args.steps, args.recorded,
                        max(1, args.threads // args.ep), timeout_s=600.0)
    summary = summarize(per_rank, moe)
    result = dict(device=device_label("cpu"), world=pp, threads=args.threads, torch=torch.__version__, preset=preset,
                  steps=args.steps, ep=args.ep, params=per_rank[0]["params"], layers=per_rank[0]["layers"],
                  costs=per_rank[0]["costs"], missing=per_rank[0]["missing"], **summary)
    result["misses"] = misses(summary)
    stem = f"pp_zero_bubble_cpu_ws{pp}" + ("_tiny" if args.tiny else "")
    write_results(result, os.path.join(out_dir(args), stem), markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
