"""ZeRO-3 step time side by side in one run: torch FSDP2 with its defaults, overlapkit's
fully_shard (FSDP2 underneath) at prefetch 0, 1, 2 and auto, overlapkit's ShardedOptimizer
(ZeRO-2: gradients reduce-scattered in backward, parameters all-gathered behind the next
forward) and PyTorch DDP, on the same GPT.

Variants take turns step by step (the order rotates every round) so that load that comes and
goes hits them alike; a step's time is the slowest rank's; the table gives medians and, for
auto, the per-round ratio to the best fixed depth and to FSDP2's defaults (target: <= 1).
Exposed gather / reduce-scatter come from the timeline recorder in separate recorded steps
(overlapkit's variants only: FSDP2 and DDP issue their collectives outside overlapkit).
Memory: on CUDA the peak allocated during one step of each variant alone; on CPU the bytes of
parameters, gradients and optimizer state a rank holds after a step, plus (ZeRO-3) the
gathered parameters that the prefetch depth holds ahead. The cost model's prediction for each
depth (`costmodel.fsdp.prefetch_wall_ms` from auto's probe) sits beside the measurement.

    python benchmarks/fsdp_overlap.py --world 4 --threads 2        # CPU, gloo
    python benchmarks/fsdp_overlap.py --device cuda                # NCCL, one rank per GPU (needs >= 2)

Writes benchmarks/results/fsdp_overlap_<device>_ws<N>.json and .md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.nn.parallel import DistributedDataParallel

from _common import add_common_args, backend, device_label, line_up, time_variants, world_size, write_results
from overlapkit.costmodel.fsdp import prefetch_wall_ms
from overlapkit.data_parallel import DataParallel, ShardedOptimizer, fully_shard, layer_report, prefetch_plan
from overlapkit.launch import spawn
from overlapkit.models.gpt import GPT, GPTConfig, lm_loss
from overlapkit.timeline import record
from overlapkit.timeline.report import measure

PRESETS = {
    # 8 blocks of 0.8 M parameters (3 MB of fp32 each): one gather per block is a real share of a block's compute.
    "cpu": dict(gpt=dict(vocab_size=2048, seq_len=64, hidden=256, num_heads=4, ffn_hidden=1024, num_layers=8), batch=2),
    "cuda": dict(gpt=dict(vocab_size=32768, seq_len=1024, hidden=2048, num_heads=16, ffn_hidden=8192, num_layers=16),
                 batch=4),
}
FIXED = ("overlapkit prefetch=0", "overlapkit prefetch=1", "overlapkit prefetch=2")
VARIANTS = ("FSDP2 defaults", *FIXED, "overlapkit prefetch=auto", "ShardedOptimizer (ZeRO-2)", "torch DDP")
RECORDED = (*FIXED, "overlapkit prefetch=auto", "ShardedOptimizer (ZeRO-2)")
MIB = 2**20


def _state_bytes(model, opt) -> int:
    seen: dict[int, int] = {}
    tensors = [t for p in model.parameters() for t in (p, p.grad) if t is not None]
    inner = getattr(opt, "optimizer", opt)
    tensors += [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    tensors += list(getattr(opt, "master", []))
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _rank_body(device_type: str, preset: dict, steps: int, warmup: int, recorded: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("dp",))
    cfg = GPTConfig(**preset["gpt"])
    group = dist.group.WORLD

    def fresh():
        torch.manual_seed(0)
        return GPT(cfg).to(device)

    models, opts = {}, {}
    plain = fresh()
    for b in plain.blocks:
        torch_fully_shard(b, mesh=mesh)
    models["FSDP2 defaults"] = torch_fully_shard(plain, mesh=mesh)
    for name, depth in zip((*FIXED, "overlapkit prefetch=auto"), (0, 1, 2, "auto")):
        models[name] = fully_shard(fresh(), mesh, prefetch=depth)
    dp = DataParallel(fresh(), group)
    models["ShardedOptimizer (ZeRO-2)"] = dp
    opts["ShardedOptimizer (ZeRO-2)"] = ShardedOptimizer(dp, torch.optim.AdamW, group, lr=1e-4)
    models["torch DDP"] = DistributedDataParallel(fresh(), process_group=group,
                                                  device_ids=[device.index] if device.type == "cuda" else None)
    for k, m in models.items():
        opts.setdefault(k, torch.optim.AdamW(m.parameters(), lr=1e-4))
    g = torch.Generator().manual_seed(1 + rank)
    idx = torch.randint(0, cfg.vocab_size, (preset["batch"], cfg.seq_len + 1), generator=g).to(device)
    x, y = idx[:, :-1], idx[:, 1:]
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else torch.autocast("cpu", enabled=False))

    def step(name: str) -> None:
        opts[name].zero_grad()
        with autocast:
            loss = lm_loss(models[name](x), y)
        loss.backward()
        opts[name].step()

    times = time_variants(step, list(VARIANTS), steps, warmup, device)

    memory = {}
    for name in VARIANTS:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            step(name)
            memory[name] = torch.cuda.max_memory_allocated(device) / MIB
        else:
            memory[name] = _state_bytes(models[name], opts[name]) / MIB

    rec_rows: dict[str, list] = {k: [] for k in RECORDED}
    for name in RECORDED:
        for _ in range(recorded):
            line_up(device)
            with record(device=device) as rec:
                step(name)
            t = measure(rec.spans)
            gathers = [s for s in rec.spans if s.kind == "zero_all_gather"]
            reduces = [s for s in rec.spans if s.kind in ("zero_reduce_scatter", "dp_reduce_scatter")]
            compute = [s for s in rec.spans if s.is_compute]
            rec_rows[name].append(dict(
                comm_ms=t.comm_ms, exposed_ms=t.exposed_comm_ms, overlap_pct=t.overlap_pct,
                exposed_gather_ms=measure(gathers + compute).exposed_comm_ms,
                exposed_reduce_ms=measure(reduces + compute).exposed_comm_ms,
                layers=[vars(r) for r in layer_report(rec.spans)] if name != "ShardedOptimizer (ZeRO-2)" else []))
    for _ in range(50):
        dp.check_layout()
    t0 = time.perf_counter()
    for _ in range(1000):
        dp.check_layout()  # DataParallel's per-forward check that no parameter was re-typed or moved
    check_us = (time.perf_counter() - t0) * 1e3
    plans = {}
    for name in (*FIXED, "overlapkit prefetch=auto"):
        plan = prefetch_plan(models[name])
        plans[name] = dict(vars(plan), held_ahead_mb=plan.prefetch_bytes / MIB)
    return dict(times=times, memory=memory, recorded=rec_rows, plans=plans, check_layout_us=check_us,
                params=sum(p.numel() for p in fresh().parameters()))


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _iqr(xs):
    xs = sorted(xs)
    return [xs[len(xs) // 4], xs[(3 * len(xs)) // 4]] if xs else None


def summarize(per_rank: list[dict]) -> dict:
    n = len(per_rank[0]["times"][VARIANTS[0]])
    steps = {k: [max(r["times"][k][i] for r in per_rank) for i in range(n)] for k in VARIANTS}
    rows = {}
    for k in VARIANTS:
        recs = [t for r in per_rank for t in r["recorded"].get(k, [])]
        rows[k] = dict(step_ms=_median(steps[k]), vs_fsdp2=_median([a / b for a, b in zip(steps[k], steps["FSDP2 defaults"])]),
                       memory_mb=max(r["memory"][k] for r in per_rank),
                       held_ahead_mb=(per_rank[0]["plans"][k]["held_ahead_mb"] if k in per_rank[0]["plans"] else None),
                       **{key: _median([t[key] for t in recs]) for key in
                          ("comm_ms", "exposed_ms", "exposed_gather_ms", "exposed_reduce_ms", "overlap_pct")})
    # The fixed depth with the best median, round by round (the per-round minimum of three noisy
    # depths would be biased low, and make even an identical configuration look slower).
    fastest_fixed = min(FIXED, key=lambda k: rows[k]["step_ms"])
    best_fixed = steps[fastest_fixed]
    auto = steps["overlapkit prefetch=auto"]
    plan = per_rank[0]["plans"]["overlapkit prefetch=auto"]
    probe, blocks = plan["probe"], len(plan["units"])
    predicted = {}
    if probe:
        for d in (0, 1, 2):
            f = prefetch_wall_ms(probe["forward_compute_ms_per_block"], probe["forward_gather_ms"], d, num_layers=blocks)
            b = prefetch_wall_ms(probe["backward_compute_ms_per_block"], probe["backward_gather_ms"], d,
                                 num_layers=blocks, reduce_ms=probe["reduce_scatter_ms"])
            predicted[f"overlapkit prefetch={d}"] = f + b
    for k, v in predicted.items():
        rows[k]["predicted_blocks_ms"] = v
    ratio_best = [a / b for a, b in zip(auto, best_fixed)]
    ratio_fsdp = [a / b for a, b in zip(auto, steps["FSDP2 defaults"])]
    return dict(rows=rows, check_layout_us=_median([r["check_layout_us"] for r in per_rank]), auto=dict(
        depths=(plan["forward_depth"], plan["backward_depth"]), reason=plan["reason"], probe=probe,
        vs_best_fixed=_median(ratio_best), vs_best_fixed_iqr=_iqr(ratio_best),
        vs_fsdp2=_median(ratio_fsdp), vs_fsdp2_iqr=_iqr(ratio_fsdp), fastest_fixed=fastest_fixed,
        layers=per_rank[0]["recorded"]["overlapkit prefetch=auto"][-1]["layers"]))


def markdown(result: dict) -> str:
    fmt = lambda v, spec: "—" if v is None else format(v, spec)  # noqa: E731
    mem = "peak allocated MiB (one step)" if result["device"] != device_label("cpu") else \
        "state MiB (params + grads + optimizer)"
    head = (f"ZeRO-3 step time, {result['device']}, world size {result['world']}, {result['threads']} threads a rank, "
            f"torch {result['torch']}: GPT {result['params'] / 1e6:.1f} M parameters, "
            f"{result['preset']['gpt']['num_layers']} blocks. Median of {result['steps']} steps (slowest rank); "
            "exposed communication from the recorder (overlapkit variants).\n\n")
    lines = [f"| variant | step ms | vs FSDP2 defaults | {mem} | gathered ahead MiB | comm ms | exposed ms | exposed gather ms "
             "| exposed RS ms | model: blocks ms |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for k, r in result["rows"].items():
        lines.append(f"| {k} | {r['step_ms']:.1f} | {r['vs_fsdp2']:.3f} | {r['memory_mb']:.1f} | {fmt(r['held_ahead_mb'], '.1f')} | "
                     f"{fmt(r['comm_ms'], '.1f')} | {fmt(r['exposed_ms'], '.1f')} | {fmt(r['exposed_gather_ms'], '.1f')} | "
                     f"{fmt(r['exposed_reduce_ms'], '.1f')} | {fmt(r.get('predicted_blocks_ms'), '.1f')} |")
    a = result["auto"]
    iqr = lambda v: "—" if v is None else "{:.3f} – {:.3f}".format(*v)  # noqa: E731
    verdict = lambda v: "met" if v is not None and v <= 1.0 else "MISSED"  # noqa: E731
    tail = (f"\n\nauto chose forward/backward depth {a['depths'][0]}/{a['depths'][1]}: {a['reason']}.\n"
            f"auto vs the fixed depth with the best median ({a['fastest_fixed']}), per round: median {a['vs_best_fixed']:.3f} (middle half "
            f"{iqr(a['vs_best_fixed_iqr'])}) — target <= 1: {verdict(a['vs_best_fixed'])}.\nauto vs FSDP2 defaults: median {a['vs_fsdp2']:.3f} (middle half "
            f"{iqr(a['vs_fsdp2_iqr'])}) — target <= 1: {verdict(a['vs_fsdp2'])}.\n\n"
            "Per block under auto (rank 0, last recorded step):\n\n| block | gather fwd ms (exposed) | "
            "gather bwd ms (exposed) | reduce-scatter ms (exposed) | hidden % |\n|---|---:|---:|---:|---:|\n")
    for L in a["layers"]:
        comm = L["forward_gather_ms"] + L["backward_gather_ms"] + L["reduce_scatter_ms"]
        exposed = L["forward_gather_exposed_ms"] + L["backward_gather_exposed_ms"] + L["reduce_scatter_exposed_ms"]
        tail += (f"| {L['name']} | {L['forward_gather_ms']:.2f} ({L['forward_gather_exposed_ms']:.2f}) | "
                 f"{L['backward_gather_ms']:.2f} ({L['backward_gather_exposed_ms']:.2f}) | "
                 f"{L['reduce_scatter_ms']:.2f} ({L['reduce_scatter_exposed_ms']:.2f}) | "
                 f"{fmt(None if comm == 0 else 100 * (1 - exposed / comm), '.0f')} |\n")
    tail += (f"\nDataParallel's per-forward layout check ({result['params'] / 1e6:.1f} M-parameter GPT): "
             f"{result['check_layout_us']:.1f} µs a call (median over ranks of 1000 calls).\n")
    return head + "\n".join(lines) + tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="untimed rounds (auto decides after its second step)")
    ap.add_argument("--recorded", type=int, default=2, help="extra recorded steps per overlapkit variant")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None, help="model size (default: the device's)")
    args = ap.parse_args(argv)
    world = world_size(args)
    if world is None:
        return 2
    if world < 2:
        print("fsdp_overlap needs --world >= 2 (nothing is sharded or gathered on one rank)", file=sys.stderr)
        return 2
    if args.warmup < 3:
        print("--warmup must be >= 3: auto measures its second step and decides at the third", file=sys.stderr)
        return 2
    preset = PRESETS[args.preset or args.device]
    per_rank = spawn(_rank_body, world, args.device, preset, args.steps, args.warmup, args.recorded, args.threads,
                     backend=backend(args.device), timeout_s=900.0)
    result = dict(device=device_label(args.device), world=world, threads=args.threads, torch=torch.__version__,
                  preset=preset, steps=args.steps, params=per_rank[0]["params"], **summarize(per_rank))
    tag = f"_{args.preset}" if args.preset and args.preset != args.device else ""
    write_results(result, os.path.join(args.out, f"fsdp_overlap_{args.device}{tag}_ws{world}"), markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
