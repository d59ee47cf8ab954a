"""ZeRO-3 step time side by side in one run: torch FSDP2 with its defaults, overlapkit's
fully_shard (FSDP2 underneath) at prefetch 0, 1, 2 and auto, overlapkit's ShardedOptimizer
(ZeRO-2: gradients reduce-scattered in backward, parameters all-gathered behind the next
forward) and PyTorch DDP, on the same GPT.

Variants take turns step by step so that load that comes and goes hits them alike; the order
of each round comes from a balanced (Williams) design, so every variant runs right after every
other equally often (a plain rotation keeps each variant's predecessor fixed: auto always ran
right after prefetch=2). A step's time is the slowest rank's; the table gives medians with
their middle half (p25-p75) and, for auto, the per-round ratio to the best fixed depth and to
FSDP2's defaults (target: <= 1; a miss is "within noise" only when the middle half straddles 1).
auto first finishes its probe and trials (it steps alone after the warm-up rounds until it has
decided); then a fixed model pinned at auto's depths (`prefetch=(forward, backward)`, built and
warmed after the decision) joins, every variant gets one more untimed round, and every timed
round runs auto's final depth. auto vs that pinned twin is auto's own cost (the configurations
are identical: tests/data_parallel/test_fsdp.py checks the same collectives, order and prefetch
lists); the twin vs the fixed depth of the same number is the run's noise floor between two
instances. `--budget-s` bounds the timed rounds: the warm-up's round time sets how many of
`--steps` fit; `--total-s` bounds the whole run (start-up, auto's trials and the tail included).
Exposed gather / reduce-scatter come from the timeline recorder in separate recorded steps
(overlapkit's variants only: FSDP2 and DDP issue their collectives outside overlapkit).
Memory: on CUDA the peak allocated during one step of each variant alone; on CPU the bytes of
parameters, gradients and optimizer state a rank holds after a step, plus (ZeRO-3) the
gathered parameters that the prefetch depth holds ahead. The cost model's prediction for each
depth (`costmodel.fsdp.prefetch_wall_ms` from auto's probe) sits beside the measurement.
Every variant steps AdamW on its foreach path (fused on CUDA; `_lib/common.adamw_options` says why the
single-tensor default would let the variant ahead in steps pay for the rest).

    python benchmarks/fsdp_overlap.py --world 4 --threads 2        # CPU, gloo
    python benchmarks/fsdp_overlap.py --world 8 --threads 2 --budget-s 120 --variants fsdp2,0,1,2,auto
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

from _lib.common import (adamw_options, add_common_args, balanced_orders, device_label, line_up, lm_train_step,
                         out_dir, print_message, run_ranks, time_variants, world_size, write_results)
from _lib.presets import FSDP_PRESETS, SMOKE_GPT
from _lib.unexported import measure, prefetch_wall_ms
from overlapkit.data_parallel import DataParallel, ShardedOptimizer, fully_shard, layer_report, prefetch_plan
from overlapkit.models import GPT, GPTConfig
from overlapkit.timeline import record


FIXED = ("overlapkit prefetch=0", "overlapkit prefetch=1", "overlapkit prefetch=2")
AUTO = "overlapkit prefetch=auto"
AUTO_TRIALS = "overlapkit prefetch=auto, trials=4"
"""auto with its opt-in trials (the default, trials=0, decides from the probe and the cost model alone):
beside the twin pinned at the default's depths, it shows what the trials leave behind."""
PINNED = "overlapkit fixed at auto's depths"
"""A fixed model at the (forward, backward) depths auto chose, built after the decision: always run."""
PINNED2 = "overlapkit fixed at auto's depths, again"
"""A second instance of PINNED, built right after it: the twin against it is the noise of two fixed instances of one
configuration, which auto against its twin is judged by."""
VARIANTS = ("FSDP2 defaults", *FIXED, AUTO, AUTO_TRIALS, "ShardedOptimizer (ZeRO-2)", "torch DDP")
RECORDED = (*FIXED, AUTO, PINNED, "ShardedOptimizer (ZeRO-2)")
SHORT = dict(zip(("fsdp2", "0", "1", "2", "auto", "auto_trials", "zero2", "ddp"), VARIANTS))
"""--variants names: fsdp2, 0, 1, 2, auto, auto_trials, zero2, ddp (auto, fsdp2 and PINNED always run: the targets compare them)."""
MAX_DECIDE_STEPS = 30
"""auto steps alone after the warm-up at most this often to finish its probe and trials."""
MIB = 2**20


def time_balanced(step, variants: list[str], rounds: int, device: torch.device) -> dict[str, list[float]]:
    """ms per step of each variant over `rounds` rounds, each round in the next balanced order."""
    return time_variants(step, variants, rounds, 0, device)


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


def _rank_body(device_type: str, preset: dict, steps: int, warmup: int, recorded: int, threads: int,
               variants: tuple[str, ...], budget_s: float, ends_at: float | None = None) -> dict:
    from _lib.unexported import progress

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
    for name, depth in zip((*FIXED, AUTO), (0, 1, 2, "auto")):
        if name in variants:
            models[name] = fully_shard(fresh(), mesh, prefetch=depth)
    if AUTO_TRIALS in variants:
        models[AUTO_TRIALS] = fully_shard(fresh(), mesh, prefetch="auto", trials=4)
    dp = None
    if "ShardedOptimizer (ZeRO-2)" in variants:
        dp = DataParallel(fresh(), group)
        models["ShardedOptimizer (ZeRO-2)"] = dp
        opts["ShardedOptimizer (ZeRO-2)"] = ShardedOptimizer(dp, torch.optim.AdamW, group, lr=1e-4)
    if "torch DDP" in variants:
        models["torch DDP"] = DistributedDataParallel(fresh(), process_group=group,
                                                      device_ids=[device.index] if device.type == "cuda" else None)
    for k, m in models.items():
        opts.setdefault(k, torch.optim.AdamW(m.parameters(), lr=1e-4, **adamw_options(device_type)))
    step = lm_train_step(models, opts, cfg.vocab_size, preset["batch"], cfg.seq_len, 1 + rank, device)

    t0 = time.perf_counter()
    time_variants(step, list(variants), 0, warmup, device)
    per_round = torch.tensor([(time.perf_counter() - t0) / warmup], dtype=torch.float64)
    dist.all_reduce(per_round, op=dist.ReduceOp.MAX)
    decide = {}  # steps each auto model ran alone until it decided
    for name in (k for k in (AUTO, AUTO_TRIALS) if k in models):
        decide[name] = 0
        while not prefetch_plan(models[name]).decided:  # decisions are collective: every rank leaves together
            if decide[name] == MAX_DECIDE_STEPS:
                raise RuntimeError(f"{name} did not decide within {MAX_DECIDE_STEPS} steps: "
                                   f"{prefetch_plan(models[name]).reason}")
            step(name)
            decide[name] += 1
    decide_steps = decide[AUTO]
    auto_plan = prefetch_plan(models[AUTO])
    for name in (PINNED, PINNED2):
        models[name] = fully_shard(fresh(), mesh, prefetch=(auto_plan.forward_depth, auto_plan.backward_depth))
        opts[name] = torch.optim.AdamW(models[name].parameters(), lr=1e-4, **adamw_options(device_type))
        for _ in range(warmup):
            step(name)  # as warm as the others before the round they all share
    variants = tuple(v for k in variants for v in ((k, PINNED, PINNED2) if k == AUTO else (k,)))  # rows under auto's
    time_balanced(step, list(variants), 1, device)  # untimed: auto ran its decision alone
    per_round *= len(variants) / (len(variants) - 2)
    if ends_at is not None:  # what is left of --total-s, less the tail (one step each, two rounds' slack)
        left = torch.tensor([ends_at - time.time() - 2 * per_round.item()], dtype=torch.float64)
        dist.all_reduce(left, op=dist.ReduceOp.MIN)
        budget_s = min(budget_s, left.item())
    rounds = max(5, min(steps, int(budget_s / per_round.item())))
    if rank == 0:
        progress(f"warm-up {warmup} rounds at {per_round.item():.2f} s a round, auto decided after {decide_steps} "
                 f"more steps; timing {rounds} rounds")
    times = time_balanced(step, list(variants), rounds, device)

    memory = {}
    for name in variants:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            step(name)
            memory[name] = torch.cuda.max_memory_allocated(device) / MIB
        else:
            memory[name] = _state_bytes(models[name], opts[name]) / MIB

    recorded_variants = [k for k in RECORDED if k in variants]
    rec_rows: dict[str, list] = {k: [] for k in recorded_variants}
    orders = balanced_orders(len(recorded_variants))
    # Interleaved like the timed rounds: a variant recorded after the others must not meet other load.
    for name in [recorded_variants[j] for r in range(recorded) for j in orders[r % len(orders)]]:
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
    check_us = None
    if dp is not None:
        for _ in range(50):
            dp.check_layout()
        t0 = time.perf_counter()
        for _ in range(1000):
            dp.check_layout()  # DataParallel's per-forward check that no parameter was re-typed or moved
        check_us = (time.perf_counter() - t0) * 1e3
    plans = {}
    for name in [k for k in (*FIXED, AUTO, AUTO_TRIALS, PINNED) if k in variants]:
        plan = prefetch_plan(models[name])
        plans[name] = dict(vars(plan), held_ahead_mb=plan.prefetch_bytes / MIB)
    return dict(times=times, memory=memory, recorded=rec_rows, plans=plans, check_layout_us=check_us,
                params=sum(p.numel() for p in fresh().parameters()), rounds=rounds, decide_steps=decide_steps,
                warmup_round_s=per_round.item())


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _iqr(xs):
    xs = sorted(xs)
    return [xs[len(xs) // 4], xs[(3 * len(xs)) // 4]] if xs else None


def summarize(per_rank: list[dict]) -> dict:
    variants = list(per_rank[0]["times"])
    n = len(per_rank[0]["times"][variants[0]])
    steps = {k: [max(r["times"][k][i] for r in per_rank) for i in range(n)] for k in variants}
    rows = {}
    for k in variants:
        recs = [t for r in per_rank for t in r["recorded"].get(k, [])]
        rows[k] = dict(step_ms=_median(steps[k]), step_iqr_ms=_iqr(steps[k]),
                       vs_fsdp2=_median([a / b for a, b in zip(steps[k], steps["FSDP2 defaults"])]),
                       memory_mb=max(r["memory"][k] for r in per_rank),
                       held_ahead_mb=(per_rank[0]["plans"][k]["held_ahead_mb"] if k in per_rank[0]["plans"] else None),
                       **{key: _median([t[key] for t in recs]) for key in
                          ("comm_ms", "exposed_ms", "exposed_gather_ms", "exposed_reduce_ms", "overlap_pct")})
    plan = per_rank[0]["plans"][AUTO]
    probe, blocks = plan["probe"], len(plan["units"])
    if probe:
        for d in (0, 1, 2):
            f = prefetch_wall_ms(probe["forward_compute_ms_per_block"], probe["forward_gather_ms"], d, num_layers=blocks)
            b = prefetch_wall_ms(probe["backward_compute_ms_per_block"], probe["backward_gather_ms"], d,
                                 num_layers=blocks, reduce_ms=probe["reduce_scatter_ms"])
            if f"overlapkit prefetch={d}" in rows:
                rows[f"overlapkit prefetch={d}"]["predicted_blocks_ms"] = f + b
    def ratio(other: str | None, of: str = AUTO) -> dict | None:
        if other is None:
            return None
        r = [a / b for a, b in zip(steps[of], steps[other])]
        return dict(of=of, to=other, median=_median(r), iqr=_iqr(r))

    # The fixed depth with the best median, round by round (the per-round minimum of three noisy
    # depths would be biased low, and make even an identical configuration look slower).
    fixed = [k for k in FIXED if k in variants]
    fastest_fixed = min(fixed, key=lambda k: rows[k]["step_ms"]) if fixed else None
    depths = (plan["forward_depth"], plan["backward_depth"])
    same = f"overlapkit prefetch={depths[0]}" if depths[0] == depths[1] and f"overlapkit prefetch={depths[0]}" in fixed \
        else None
    return dict(rows=rows, rounds=per_rank[0]["rounds"], decide_steps=per_rank[0]["decide_steps"],
                warmup_round_s=per_rank[0]["warmup_round_s"],
                check_layout_us=_median([r["check_layout_us"] for r in per_rank]), auto=dict(
                    depths=depths, reason=plan["reason"], probe=probe, measured=plan.get("measured", {}),
                    vs_best_fixed=ratio(fastest_fixed), vs_fsdp2=ratio("FSDP2 defaults"), vs_same_depth=ratio(same),
                    vs_pinned=ratio(PINNED), pinned_vs_same_depth=ratio(same, of=PINNED),
                    pinned2_vs_pinned=ratio(PINNED, of=PINNED2),
                    trials_vs_pinned=ratio(PINNED, of=AUTO_TRIALS) if AUTO_TRIALS in steps else None,
                    vs_fixed={k: ratio(k) for k in fixed},
                    layers=per_rank[0]["recorded"][AUTO][-1]["layers"] if per_rank[0]["recorded"].get(AUTO) else []))


def straddles(r: dict, at: float = 1.0) -> bool:
    """Whether the middle half of the per-round ratios holds `at`: rounds fall on either side."""
    return r["iqr"][0] <= at <= r["iqr"][1]


def verdict(r: dict | None, limit: float = 1.0) -> str:
    """met (median <= limit), within noise (a miss whose middle half of per-round ratios straddles
    the limit), or MISSED."""
    if r is None or r["median"] is None:
        return "not run"
    if r["median"] <= limit:
        return "met"
    return "within noise" if straddles(r, limit) else "MISSED"


TARGETS = {"fsdp2": 0.9, "best fixed": 1.01, "pinned": 0.01}
"""issue targets: auto <= 0.9x FSDP2's defaults; <= 1.01x its best fixed depth; within 1 % of its pinned twin."""


def same_config(r: dict) -> str:
    """What the ratio between two identical configurations says: noise only if it straddles 1."""
    if straddles(r):
        return "within noise (the middle half straddles 1)"
    side = "slower" if r["iqr"][0] > 1.0 else "faster"
    return (f"a systematic gap, not noise: {side} in at least three rounds in four at an identical "
            "configuration")


def markdown(result: dict) -> str:
    fmt = lambda v, spec: "—" if v is None else format(v, spec)  # noqa: E731
    mem = "peak allocated MiB (one step)" if result["device"] != device_label("cpu") else \
        "state MiB (params + grads + optimizer)"
    head = (f"ZeRO-3 step time, {result['device']}, world size {result['world']}, {result['threads']} threads a rank, "
            f"torch {result['torch']}: GPT {result['params'] / 1e6:.1f} M parameters, "
            f"{result['preset']['gpt']['num_layers']} blocks. Median (and middle half, p25–p75) of {result['rounds']} "
            f"balanced-order rounds (slowest rank; {result['warmup_round_s']:.2f} s a warm-up round, auto decided "
            f"{result['decide_steps']} steps after the warm-up; the run took {result['wall_s']:.0f} s); exposed "
            "communication from the recorder (overlapkit variants).\n\n")
    lines = [f"| variant | step ms | p25–p75 ms | vs FSDP2 defaults | {mem} | gathered ahead MiB | comm ms | exposed ms "
             "| exposed gather ms | exposed RS ms | model: blocks ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for k, r in result["rows"].items():
        iqr = "{:.1f}–{:.1f}".format(*r["step_iqr_ms"])
        lines.append(f"| {k} | {r['step_ms']:.1f} | {iqr} | {r['vs_fsdp2']:.3f} | {r['memory_mb']:.1f} | "
                     f"{fmt(r['held_ahead_mb'], '.1f')} | {fmt(r['comm_ms'], '.1f')} | {fmt(r['exposed_ms'], '.1f')} | "
                     f"{fmt(r['exposed_gather_ms'], '.1f')} | {fmt(r['exposed_reduce_ms'], '.1f')} | "
                     f"{fmt(r.get('predicted_blocks_ms'), '.1f')} |")
    a = result["auto"]

    def said(what: str, r: dict | None, limit: float | None = 1.0, within: float | None = None) -> str:
        if r is None:
            return ""
        who = "auto" if r["of"] == AUTO else r["of"]
        line = (f"{who} vs {what} ({r['to']}), per round: median {r['median']:.3f} (middle half "
                f"{r['iqr'][0]:.3f} – {r['iqr'][1]:.3f})")
        if within is not None:  # identical configurations: a target on the gap, and what the spread says
            met = "met" if abs(r["median"] - 1) <= within and straddles(r) else "MISSED"
            return line + f" — target within {within:.0%}: {met}; {same_config(r)}.\n"
        return line + (f" — target <= {limit:g}: {verdict(r, limit)}.\n" if limit else f": {same_config(r)}.\n")

    tail = (f"\n\nauto chose forward/backward depth {a['depths'][0]}/{a['depths'][1]}: {a['reason']}.\n"
            + said("the fixed depth with the best median", a["vs_best_fixed"], TARGETS["best fixed"])
            + said("FSDP2 defaults", a["vs_fsdp2"], TARGETS["fsdp2"])
            + "".join(said("a fixed depth", r, TARGETS["best fixed"]) for r in a.get("vs_fixed", {}).values())
            + said("the fixed model pinned at its depths, built after its decision", a.get("vs_pinned"),
                   within=TARGETS["pinned"])
            + said("the same fixed depth", a["vs_same_depth"], within=TARGETS["pinned"])
            + said("the first instance (two fixed instances of auto's depths: the noise auto vs its twin is judged by)",
                   a.get("pinned2_vs_pinned"), None)
            + said("the fixed depth of the same number (another instance of one configuration: the run's noise "
                   "floor)", a.get("pinned_vs_same_depth"), None)
            + said("the fixed model pinned at the default auto's depths (what the trials leave, where they keep those depths)",
                   a.get("trials_vs_pinned"), None))
    if a["layers"]:
        tail += ("\nPer block under auto (rank 0, last recorded step):\n\n| block | gather fwd ms (exposed) | "
                 "gather bwd ms (exposed) | reduce-scatter ms (exposed) | hidden % |\n|---|---:|---:|---:|---:|\n")
    for L in a["layers"]:
        comm = L["forward_gather_ms"] + L["backward_gather_ms"] + L["reduce_scatter_ms"]
        exposed = L["forward_gather_exposed_ms"] + L["backward_gather_exposed_ms"] + L["reduce_scatter_exposed_ms"]
        tail += (f"| {L['name']} | {L['forward_gather_ms']:.2f} ({L['forward_gather_exposed_ms']:.2f}) | "
                 f"{L['backward_gather_ms']:.2f} ({L['backward_gather_exposed_ms']:.2f}) | "
                 f"{L['reduce_scatter_ms']:.2f} ({L['reduce_scatter_exposed_ms']:.2f}) | "
                 f"{fmt(None if comm == 0 else 100 * (1 - exposed / comm), '.0f')} |\n")
    if result["check_layout_us"] is not None:
        tail += (f"\nDataParallel's per-forward layout check ({result['params'] / 1e6:.1f} M-parameter GPT): "
                 f"{result['check_layout_us']:.1f} µs a call (median over ranks of 1000 calls).\n")
    return head + "\n".join(lines) + tail


def main(argv: list[str] | None = None) -> int:
    started = time.time()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--steps", type=int, default=20, help="timed rounds at most (see --budget-s)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds of every variant before auto finishes deciding")
    ap.add_argument("--recorded", type=int, default=2, help="extra recorded steps per overlapkit variant")
    ap.add_argument("--budget-s", type=float, default=120.0,
                    help="seconds the timed rounds may take (the warm-up's round time sets how many; at least 5)")
    ap.add_argument("--total-s", type=float, default=None,
                    help="seconds the whole run may take: the timed rounds get what start-up and auto's trials left")
    ap.add_argument("--variants", default=",".join(SHORT),
                    help=f"comma-separated subset of {','.join(SHORT)} (fsdp2, auto and a fixed model pinned at "
                         "auto's depths always run)")
    ap.add_argument("--preset", choices=sorted(FSDP_PRESETS), default=None, help="model size (default: the device's)")
    args = ap.parse_args(argv)
    if args.smoke:  # the tiny GPT, the fewest rounds (5), one warm-up round, one recorded step
        args.steps, args.warmup, args.recorded = 1, 1, 1
    world = world_size(args)
    if world is None:
        return 2
    if world < 2:
        print("fsdp_overlap needs --world >= 2 (nothing is sharded or gathered on one rank)", file=sys.stderr)
        return 2
    asked = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in asked if v not in SHORT]
    if unknown or args.warmup < 1 or not args.budget_s > 0:
        print(f"--variants {unknown} not among {list(SHORT)}" if unknown else "--warmup must be >= 1 and --budget-s > 0",
              file=sys.stderr)
        return 2
    variants = tuple(v for v in VARIANTS if v in {SHORT[a] for a in asked} | {"FSDP2 defaults", AUTO})
    preset = dict(gpt=SMOKE_GPT, batch=1) if args.smoke else FSDP_PRESETS[args.preset or args.device]
    per_rank = run_ranks(_rank_body, world, args.device, preset, args.steps, args.warmup, args.recorded, args.threads,
                         variants, args.budget_s, None if args.total_s is None else started + args.total_s,
                         device=args.device, timeout_s=900.0, on_message=print_message)
    result = dict(device=device_label(args.device), world=world, threads=args.threads, torch=torch.__version__,
                  preset=preset, steps=args.steps, params=per_rank[0]["params"], **summarize(per_rank),
                  wall_s=time.time() - started)
    tag = f"_{args.preset}" if args.preset and args.preset != args.device else ""
    write_results(result, os.path.join(out_dir(args), f"fsdp_overlap_{args.device}{tag}_ws{world}"), markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
