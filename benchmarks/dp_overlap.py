"""Data-parallel step time, side by side in one run: overlapkit DataParallel with the bucket
reductions overlapped with backward, the same without overlap (all reductions after
backward), PyTorch DistributedDataParallel, and the same model with no communication at all;
and DataParallel's default `bucket_mb="auto"` beside each of the caps it chooses from, fixed.
auto's trials run before anything is timed (they are its first training steps); its ratios to
the best fixed cap, to DDP and to the fixed cap it kept are per round.

Variants take turns step by step (each round in the next order of a balanced design), so
that load that comes and goes on a shared machine hits them alike. A step's time is the
slowest rank's; the table gives the median over the timed steps. Exposed communication of overlapkit's variants comes
from the timeline recorder (communication not covered by forward/backward compute, recorded
in separate steps after the timed ones so that recording never slows a timed step); for
every variant, "step − no-comm" is what communication and its bookkeeping added.

    python benchmarks/dp_overlap.py                       # CPU, gloo, 2 ranks
    python benchmarks/dp_overlap.py --world 4 --threads 3 --budget-s 40   # the 16-core GPU host's CPU
    python3 benchmarks/dp_overlap.py --device cuda        # NCCL, one rank per visible GPU
    python benchmarks/dp_overlap.py --world 4 --threads 3 --budget-s 60   # + auto, on the 16 cores

`--budget-s` bounds the timed rounds: the warm-up's round time sets how many of `--steps` fit.
Writes benchmarks/results/dp_overlap_<device>.json and .md (CPU at another world size than 2:
dp_overlap_cpu_ws<N>).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from _lib.common import (add_common_args, device_label, line_up, lm_train_step, out_dir, run_ranks, time_variants,
                         world_size, write_results)
from _lib.presets import DP_PRESETS as PRESETS, SMOKE_DP
from _lib.ratios import per_round, text, verdict
from _lib.unexported import bucket_auto, measure
from overlapkit.data_parallel import DataParallel
from overlapkit.models import GPT, GPTConfig
from overlapkit.timeline import record

VARIANTS = ("overlapkit overlap=True", "overlapkit overlap=False", "torch DDP", "no communication")
AUTO = "overlapkit auto"
DDP_TARGET = 0.98
"""DataParallel's default step at most this share of DDP's (and within 1 % of its own overlap=False)."""
AUTO_TARGET = 1.01
"""auto at most this share of the best fixed cap's step."""
SMOKE_CAP_SCALE = 1 / 1024
"""Under --smoke auto's caps are KiB instead of MiB, so that the tiny GPT has candidates to time."""


def fixed_caps(preset: dict, scale: float) -> dict[float, str]:
    """auto's candidate caps (MiB) and the fixed variant that runs each; the preset's cap is overlap=True's."""
    return {c * scale: VARIANTS[0] if c * scale == preset["bucket_mb"] else f"overlapkit bucket_mb={c * scale:g}"
            for c in bucket_auto.AUTO_CAPS_MB}


def variants(preset: dict, scale: float) -> list[str]:
    extra = [n for n in fixed_caps(preset, scale).values() if n != VARIANTS[0]]
    return [*VARIANTS, AUTO, *extra]


def _rank_body(device_type: str, preset: dict, steps: int, warmup: int, recorded: int, seed: int,
               threads: int | None = None, budget_s: float | None = None, cap_scale: float = 1.0) -> dict:
    if threads is not None:
        torch.set_num_threads(threads)
    bucket_auto.FINE_MB *= cap_scale
    bucket_auto.AUTO_CAPS_MB = tuple(c * cap_scale for c in bucket_auto.AUTO_CAPS_MB)
    names = variants(preset, 1.0)  # the caps are scaled already
    rank = dist.get_rank()
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    cfg = GPTConfig(**preset["gpt"])
    group = dist.group.WORLD

    def fresh():
        torch.manual_seed(seed)
        return GPT(cfg).to(device)

    models = {
        VARIANTS[0]: DataParallel(fresh(), group, overlap=True, bucket_mb=preset["bucket_mb"]),
        VARIANTS[1]: DataParallel(fresh(), group, overlap=False, bucket_mb=preset["bucket_mb"]),
        VARIANTS[2]: DistributedDataParallel(fresh(), process_group=group, bucket_cap_mb=preset["bucket_mb"],
                                             device_ids=[device.index] if device.type == "cuda" else None),
        VARIANTS[3]: fresh(),
        # (first bucket: 1 MiB, the default, scaled with the caps under --smoke)
        AUTO: DataParallel(fresh(), group, first_bucket_mb=cap_scale),
        **{name: DataParallel(fresh(), group, bucket_mb=cap, first_bucket_mb=cap_scale)
           for cap, name in fixed_caps(preset, 1.0).items() if name != VARIANTS[0]},
    }
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    step = lm_train_step(models, opts, cfg.vocab_size, preset["batch"], cfg.seq_len, seed + rank, device)

    # auto decides on its first training steps (every rank the same number): run them before timing.
    choice, t0, calls = models[AUTO].bucket_choice, time.perf_counter(), 0
    while choice.decided is None:
        step(AUTO)
        calls += 1
    auto = dict(kept_mb=choice.decided, reason=choice.reason, calls=calls, seconds=time.perf_counter() - t0,
                buckets=len(models[AUTO].sync.buffer.buckets), fine=len(models[AUTO].sync.buffer.fine))

    t0 = time.perf_counter()
    time_variants(step, names, 0, warmup, device)
    if budget_s is not None:  # every rank times the same number of rounds: the slowest rank's round time
        per_round = torch.tensor([(time.perf_counter() - t0) / max(1, warmup)], dtype=torch.float64, device=device)
        dist.all_reduce(per_round, op=dist.ReduceOp.MAX)
        steps = max(5, min(steps, int(budget_s / per_round.item())))
    times = time_variants(step, names, steps, 0, device)

    ours = [n for n in names if n.startswith("overlapkit")]
    per_step: dict[str, list] = {k: [] for k in ours}
    with record(device=device) as rec:
        for _ in range(recorded):
            for name in ours:
                line_up(device)
                rec.next_step()
                step(name)
                per_step[name].append(rec.step)
    by_step: dict[int, list] = {}
    for s in rec.spans:
        by_step.setdefault(s.step, []).append(s)
    recorded_times = {name: [asdict(measure(by_step.get(k, []))) for k in ks] for name, ks in per_step.items()}
    comm_bytes = sum(s.nbytes for s in by_step.get(per_step[VARIANTS[0]][0], []) if s.name.startswith("bucket"))
    return dict(times=times, recorded=recorded_times, comm_bytes=comm_bytes, steps=steps,
                params=sum(p.numel() for p in models[VARIANTS[3]].parameters()),
                buckets=len(models[VARIANTS[0]].sync.buffer.buckets), auto=auto,
                buckets_per_variant={n: len(models[n].sync.buffer.buckets) for n in ours})


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(per_rank: list[dict]) -> dict:
    """Slowest rank per step, median over steps; ratios to DDP and to no-comm taken round by round
    (the variants of one round ran back to back, under the same load), then the median; recorder
    numbers as medians over steps and ranks."""
    steps = {name: [max(r["times"][name][i] for r in per_rank) for i in range(len(per_rank[0]["times"][name]))]
             for name in per_rank[0]["times"]}
    rows = {}
    for name, step in steps.items():
        row = rows[name] = {"step_ms": _median(step), "step_ms_all": step}
        ratios = sorted(a / b for a, b in zip(step, steps["torch DDP"]))
        row["vs_ddp"] = _median(ratios)
        row["vs_ddp_iqr"] = [ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]] if ratios else None
        row["added_by_comm_ms"] = _median([a - b for a, b in zip(step, steps["no communication"])])
        recs = [t for r in per_rank for t in r["recorded"].get(name, [])]
        for key in ("exposed_comm_ms", "comm_ms", "overlap_pct", "t_last_ms"):
            vals = [t[key] for t in recs if t[key] is not None]
            row[key] = _median(vals) if vals else None
    return rows


def auto_summary(result: dict) -> dict:
    """auto's kept cap and its per-round ratios to the fastest fixed cap, the cap it kept, DDP and overlap=False."""
    rows, scale = result["rows"], result["cap_scale"]
    caps = fixed_caps(result["preset"], scale)
    best = min(caps.values(), key=lambda n: rows[n]["step_ms"])
    auto = dict(result["auto"])
    kept = next(n for c, n in caps.items() if abs(c - auto["kept_mb"]) <= 1e-12 * max(1.0, c))
    step = {n: r["step_ms_all"] for n, r in rows.items()}
    auto.update(best_fixed=best, kept_variant=kept,
                vs_best_fixed=per_round(step[AUTO], step[best]), vs_kept=per_round(step[AUTO], step[kept]),
                vs_ddp=per_round(step[AUTO], step["torch DDP"]), vs_no_overlap=per_round(step[AUTO], step[VARIANTS[1]]))
    return auto


def markdown(result: dict) -> str:
    head = (f"DP step time, {result['device']}, world size {result['world']}, torch {result['torch']}: "
            f"GPT {result['params'] / 1e6:.1f} M parameters, {result['comm_mb']:.1f} MB reduced per step "
            f"in {result['buckets']} buckets (cap {result['preset']['bucket_mb']:g} MiB, first 1 MiB). "
            f"Median of {result['steps']} steps (slowest rank); 'vs DDP' and 'step − no-comm' are medians "
            "of per-round ratios and differences; exposed comm, comm and overlap from the recorder.\n\n")
    lines = ["| variant | step ms | vs DDP | vs DDP, middle half of rounds | step − no-comm ms | exposed comm ms "
             "| comm ms | overlap % |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    fmt = lambda v, spec: "—" if v is None else format(v, spec)  # noqa: E731
    for name, row in result["rows"].items():
        iqr = "—" if row["vs_ddp_iqr"] is None else "{:.3f} – {:.3f}".format(*row["vs_ddp_iqr"])
        lines.append(f"| {name} | {row['step_ms']:.2f} | {row['vs_ddp']:.3f} | {iqr} | {row['added_by_comm_ms']:.2f} | "
                     f"{fmt(row['exposed_comm_ms'], '.2f')} | {fmt(row['comm_ms'], '.2f')} | "
                     f"{fmt(row['overlap_pct'], '.0f')} |")
    rows = result["rows"]
    ours = rows[VARIANTS[0]]["step_ms_all"]
    tail = "".join(
        f"\n{VARIANTS[0]} vs {other}, per round: {text(r)} — target <= {target:g}: {verdict(r, target)}."
        for other, target, r in (("torch DDP", DDP_TARGET, per_round(ours, rows["torch DDP"]["step_ms_all"])),
                                 (VARIANTS[1], 1.01, per_round(ours, rows[VARIANTS[1]]["step_ms_all"]))))
    a = result["auto_summary"]
    tail += (f"\n\n`bucket_mb=\"auto\"` kept {a['kept_mb']:g} MiB ({a['buckets']} collectives of {a['fine']} fine "
             f"buckets), deciding at its training step {a['calls']} ({a['seconds']:.1f} s of steps, before the "
             f"timed rounds): {a['reason']}.\n\n"
             "| auto vs | per round (middle half) | target | verdict |\n|---|---|---|---|\n"
             f"| best fixed cap ({a['best_fixed']}) | {text(a['vs_best_fixed'])} | ≤ {AUTO_TARGET:g} | "
             f"{verdict(a['vs_best_fixed'], AUTO_TARGET)} |\n"
             f"| the fixed cap it kept ({a['kept_variant']}) | {text(a['vs_kept'])} | ≤ {AUTO_TARGET:g} | "
             f"{verdict(a['vs_kept'], AUTO_TARGET)} |\n"
             f"| torch DDP | {text(a['vs_ddp'])} | ≤ {DDP_TARGET:g} | {verdict(a['vs_ddp'], DDP_TARGET)} |\n"
             f"| {VARIANTS[1]} | {text(a['vs_no_overlap'])} | ≤ {AUTO_TARGET:g} | "
             f"{verdict(a['vs_no_overlap'], AUTO_TARGET)} |\n")
    return head + "\n".join(lines) + "\n" + tail + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--recorded", type=int, default=3, help="extra recorded steps per overlapkit variant")
    ap.add_argument("--bucket-mb", type=float, default=None, help="bucket cap for overlapkit and DDP alike")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None, help="model size (default: the device's)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: torch's)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds the timed rounds may take (the warm-up's round time sets how many; at least 5)")
    args = ap.parse_args(argv)
    world = world_size(args)
    if world is None:
        return 2
    preset_name = args.preset or args.device
    preset = dict(SMOKE_DP if args.smoke else PRESETS[preset_name])
    if args.smoke:  # the tiny GPT, two rounds after one, one recorded step
        args.steps, args.warmup, args.recorded = 2, 1, 1
    if args.bucket_mb is not None:
        preset["bucket_mb"] = args.bucket_mb
    scale = SMOKE_CAP_SCALE if args.smoke else 1.0
    per_rank = run_ranks(_rank_body, world, args.device, preset, args.steps, args.warmup, args.recorded, 0,
                         args.threads, args.budget_s, scale, device=args.device, timeout_s=600.0)
    result = dict(device=device_label(args.device),
                  world=world, torch=torch.__version__, preset=preset, steps=per_rank[0]["steps"], threads=args.threads,
                  params=per_rank[0]["params"], buckets=per_rank[0]["buckets"],
                  comm_mb=per_rank[0]["comm_bytes"] / 1e6, rows=summarize(per_rank), cap_scale=scale,
                  auto=per_rank[0]["auto"], buckets_per_variant=per_rank[0]["buckets_per_variant"])
    result["auto_summary"] = auto_summary(result)
    # dp_overlap_cpu / dp_overlap_cuda for the default runs; preset and GPU count named otherwise
    tag = ("" if preset_name == args.device else f"_{preset_name}") + \
        (f"_ws{world}" if (args.device == "cuda" and world > 1) or (args.device == "cpu" and world != 2) else "")
    write_results(result, os.path.join(out_dir(args), f"dp_overlap_{args.device}{tag}"), markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
