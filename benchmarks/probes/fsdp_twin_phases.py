"""Where a decided ZeRO-3 `prefetch="auto"` model loses time to its pinned twin, phase by phase.

The question (issue: what `auto` costs once it has decided): on the GPU host's 16 cores (8 ranks x 1
thread, `fsdp_overlap.py`, 2026-12-07) auto read 1.076x the fixed model pinned at its depths, slower in
three rounds in four, while two pinned instances differed by 1.011x; the traces of one step (aten ops and
shapes, collectives in order, hooks, held tensors) compare equal at 2 and 3 ranks. This probe bisects in
time and in instance rather than in calls:

- two auto models, built side by side and decided one after the other (`auto A`, `auto B`): if both are
  slower than the twins, the residue is auto's; if one is not, it is the instance (where its memory and
  threads landed), not auto;
- the twin pinned at auto A's depths built after the decision (`pinned`; `pinned B` too where B decided other
  depths, as on the 16 cores' first run) and the fixed model of the same depths built before it (`fixed`,
  when A's depths are one number);
- each step split into forward + loss, backward, and optimizer step + zero_grad (host clock, all ranks
  lined up before the step only, so the phases overlap as in training), slowest rank per phase;
- beside each variant, the Python garbage collections a step triggered (by generation, the time they took and
  the objects they freed, from `gc.callbacks`) and the threads alive after it;
- after the rounds, what a step of each variant leaves that only the cyclic collector frees, by type, and what
  it leaves reachable that was not before (a growing list or cache), by type (the decided autos collected ~15x
  as often as the twin on the 16 cores under torch 2.11: this names what they leave).

Found (2026-12-07, torch 2.11): the residue was AdamW's single-tensor path over DTensors, whose per-step scalars
key FakeTensor's process-wide dispatch cache, so only the model first at each step count paid the propagation
(`--optimizer single` shows it; the default, foreach, is what the benchmarks now step).

    python benchmarks/probes/fsdp_twin_phases.py --world 8 --threads 1 --rounds 30

Writes benchmarks/results/fsdp_twin_phases_<device>_ws<N>.{json,md}.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _lib
from _lib.common import (add_common_args, balanced_orders, device_label, line_up, out_dir, print_message, run_ranks,
                         world_size, write_results)
from _lib.presets import FSDP_PRESETS, SMOKE_GPT
from overlapkit.data_parallel import fully_shard, prefetch_plan
from overlapkit.models import GPT, GPTConfig, lm_loss

PHASES = ("forward", "backward", "optimizer")
OPTIMIZERS = {"foreach": dict(foreach=True), "single": {}}
OPTIMIZERS_HELP = ("AdamW's foreach path (default), or 'single': torch's default over DTensor parameters, the "
                   "single-tensor path. Under torch 2.11 its per-step scalars key FakeTensor's dispatch cache, so in "
                   "one process only the model that first reaches each step count pays the propagation and the "
                   "others hit its entries: the decided autos, ahead by their deciding steps, paid it for the twins")
MAX_DECIDE_STEPS = 30


class _Collections:
    """gc.callbacks entry: the collections since `reset()`, by generation, their time and the objects they freed."""

    def __init__(self) -> None:
        self.reset()
        self._start = 0.0

    def reset(self) -> None:
        self.by_gen, self.ms, self.freed = [0, 0, 0], 0.0, 0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        self.by_gen[info["generation"]] += 1
        self.ms += 1e3 * (time.perf_counter() - self._start)
        self.freed += info["collected"]

    def totals(self) -> tuple:
        """(collections, [gen 0, 1, 2], ms, objects freed)."""
        return sum(self.by_gen), list(self.by_gen), self.ms, self.freed


def _rank_body(gpt: dict, batch: int, rounds: int, warmup: int, threads: int, optimizer: str) -> dict:
    torch.set_num_threads(threads)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    cfg = GPTConfig(**gpt)

    def fresh(prefetch):
        torch.manual_seed(0)
        return fully_shard(GPT(cfg), mesh, prefetch=prefetch)

    models = {"auto A": fresh("auto"), "auto B": fresh("auto")}
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g)
    opts = {}
    collector = _Collections()
    gc.callbacks.append(collector)

    def step(name: str, mark=_unmarked) -> tuple:
        model = models[name]
        if name not in opts:  # once: setdefault would build (and drop) an optimizer every step
            opts[name] = torch.optim.AdamW(model.parameters(), lr=1e-4, **OPTIMIZERS[optimizer])
        opt = opts[name]
        collector.reset()
        t0 = time.perf_counter()
        mark("forward")
        loss = lm_loss(model(idx[:, :-1]), idx[:, 1:])
        t1 = time.perf_counter()
        mark("backward")
        loss.backward()
        t2 = time.perf_counter()
        mark("optimizer")
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        return 1e3 * (t1 - t0), 1e3 * (t2 - t1), 1e3 * (t3 - t2), *collector.totals()

    decided_after = {}
    for name in ("auto A", "auto B"):
        n = 0
        while not prefetch_plan(models[name]).decided:
            if n == MAX_DECIDE_STEPS:
                raise RuntimeError(f"{name} did not decide in {MAX_DECIDE_STEPS} steps")
            step(name)
            n += 1
        decided_after[name] = n
    decided = {n: (prefetch_plan(models[n]).forward_depth, prefetch_plan(models[n]).backward_depth)
               for n in ("auto A", "auto B")}
    depths = decided["auto A"]
    models["pinned"] = fresh(depths)
    if decided["auto B"] != depths:  # the 16 cores' first run: the two decided apart; each gets its own twin
        models["pinned B"] = fresh(decided["auto B"])
    if depths[0] == depths[1]:
        models["fixed"] = fresh(depths[0])
    names = list(models)
    times = {n: [] for n in names}
    orders = balanced_orders(len(names))
    for i in range(warmup + rounds):
        for name in (names[j] for j in orders[i % len(orders)]):
            line_up(torch.device("cpu"))
            got = step(name)
            if i >= warmup:
                times[name].append(got)
    _cyclic_garbage(lambda: step(names[-1]))  # untimed: the probe's own first use leaves ~10 objects reachable
    return dict(times=times, depths=decided, decided_after=decided_after, threads=threading.active_count(),
                garbage={n: _cyclic_garbage(lambda n=n: step(n)) for n in names},
                misses={n: _propagation_misses(lambda mark, n=n: step(n, mark)) for n in names})


def _unmarked(_phase: str) -> None:
    pass


def _cache_counters() -> dict:
    """Counters of DTensor's propagation caches that this torch has (names -> a function reading each): the
    sharding cache's misses (a Python LRU under torch 2.11; 2.13 caches in C++ before it), the tensor-meta LRU's
    misses (128 entries: more distinct ops a step thrash it), FakeTensor's dispatch cache size (what a miss
    propagates through; it grew by 9 entries a step in the first auto under torch 2.11)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import DTensor

    prop = DTensor._op_dispatcher.sharding_propagator
    out = {}
    if hasattr(sharding := prop.__dict__.get("propagate_op_sharding"), "cache_info"):
        out["sharding misses"] = lambda: sharding.cache_info().misses
    if hasattr(meta := getattr(type(prop), "_propagate_tensor_meta_cached", None), "cache_info"):
        out["tensor-meta misses"] = lambda: meta.cache_info().misses
    if isinstance(getattr(FakeTensorMode, "cache", None), dict):
        out["fake dispatch cache size"] = lambda: len(FakeTensorMode.cache)
    return out


def _propagation_misses(step) -> dict:
    """What a step (over `GARBAGE_STEPS` steps) added to each of `_cache_counters()`, per phase: an op whose
    cache key changes every step (a per-step scalar, a spec that differs) propagates again every step."""
    from collections import Counter

    counters = _cache_counters()
    if not counters:
        return {"per_step": {}, "unavailable": "none of the caches this probe reads exists in this torch"}
    added = Counter()
    state = {"phase": None, "at": {}}

    def mark(p):  # what the counters gained since the last mark belongs to the phase that ran
        now = {k: f() for k, f in counters.items()}
        if state["phase"] is not None:
            for k, v in now.items():
                added[f"{state['phase']} {k}"] += v - state["at"][k]
        state.update(phase=p, at=now)

    for _ in range(GARBAGE_STEPS):
        step(mark)
        mark(None)
    return {"per_step": {k: c / GARBAGE_STEPS for k, c in added.items() if c}}


GARBAGE_STEPS = 3


def _cyclic_garbage(step) -> dict:
    """What `GARBAGE_STEPS` steps leave that only the cyclic collector frees, by type, per step: each step between
    two full collections with DEBUG_SAVEALL (the unreachable objects kept in gc.garbage to be counted)."""
    from collections import Counter

    counts: Counter = Counter()
    gc.collect()
    before = Counter(type(o).__qualname__ for o in gc.get_objects())
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(GARBAGE_STEPS):
            gc.garbage.clear()
            step()
            gc.collect()
            counts.update(type(o).__qualname__ for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    gc.collect()
    # What stays reachable: a list or cache that grows a step (a leak the cyclic count cannot see, and one
    # that would make the collector run more often: each step's new objects push generation 0 over its threshold).
    grown = Counter(type(o).__qualname__ for o in gc.get_objects())
    grown.subtract(before)
    grown = Counter({k: v for k, v in grown.items() if v > 0})
    return {"total": sum(counts.values()) / GARBAGE_STEPS,
            "types": {k: v / GARBAGE_STEPS for k, v in counts.most_common(8)},
            "grown": sum(grown.values()) / GARBAGE_STEPS,
            "grown_types": {k: v / GARBAGE_STEPS for k, v in grown.most_common(8)}}


def _summary(per_rank: list[dict]) -> dict:
    names = list(per_rank[0]["times"])
    rounds = len(per_rank[0]["times"][names[0]])
    rows = {}
    for n in names:
        phase = {p: [max(r["times"][n][i][k] for r in per_rank) for i in range(rounds)] for k, p in enumerate(PHASES)}
        step = [max(sum(r["times"][n][i][:3]) for r in per_rank) for i in range(rounds)]
        rows[n] = dict(step_ms=statistics.median(step), **{f"{p}_ms": statistics.median(v) for p, v in phase.items()},
                       gc_per_step=statistics.mean(t[3] for r in per_rank for t in r["times"][n]),
                       gc_by_generation=[statistics.mean(t[4][k] for r in per_rank for t in r["times"][n]) for k in range(3)],
                       gc_ms_per_step=statistics.mean(t[5] for r in per_rank for t in r["times"][n]),
                       gc_freed_per_step=statistics.mean(t[6] for r in per_rank for t in r["times"][n]), steps=step)
    for n, row in rows.items():
        ref = rows["pinned B" if n in ("auto B", "pinned B") and "pinned B" in rows else "pinned"]["steps"]
        ratios = sorted(a / b for a, b in zip(row["steps"], ref))
        row["vs_pinned"] = statistics.median(ratios)
        row["vs_pinned_middle_half"] = (ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4])
    return dict(rows=rows, depths=per_rank[0]["depths"], decided_after=per_rank[0]["decided_after"],
                garbage=per_rank[0]["garbage"], misses=per_rank[0]["misses"],
                threads=max(r["threads"] for r in per_rank), rounds=rounds)


def _markdown(result: dict) -> str:
    a = result["args"]
    lines = [f"ZeRO-3 auto beside its twins, phase by phase: {result['device']}, {a['world']} ranks x {a['threads']} "
             f"thread(s), GPT {result['gpt']['hidden']} x {result['gpt']['num_layers']}, AdamW "
             f"{a.get('optimizer', 'single')}, {result['rounds']} rounds in a "
             f"balanced order; auto decided {result['depths']} (steps to decide: {result['decided_after']}); slowest "
             f"rank, medians; threads alive after: {result['threads']}", "",
             "| variant | step ms | vs its pinned twin (middle half) | forward ms | backward ms | optimizer ms | gc / step "
             "(gen 0 / 1 / 2) | gc ms / step | freed / step |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for n, r in result["rows"].items():
        lo, hi = r["vs_pinned_middle_half"]
        lines.append(f"| {n} | {r['step_ms']:.1f} | {r['vs_pinned']:.3f} ({lo:.3f}–{hi:.3f}) | {r['forward_ms']:.1f} | "
                     f"{r['backward_ms']:.1f} | {r['optimizer_ms']:.1f} | {r['gc_per_step']:.2f} ("
                     f"{' / '.join(f'{g:.2f}' for g in r['gc_by_generation'])}) | {r['gc_ms_per_step']:.2f} | "
                     f"{r['gc_freed_per_step']:.0f} |")
    lines += ["", f"Left for the cyclic collector a step (rank 0, {GARBAGE_STEPS} steps after the timed rounds, each "
              "between two full collections; its 8 most common types):", ""]
    lines += [f"- {n}: {g['total']:.0f} objects" + (": " + ", ".join(f"{k} {v:.0f}" for k, v in g["types"].items())
                                                      if g["types"] else "") for n, g in result["garbage"].items()]
    lines += ["", "What a step added to DTensor's propagation caches (misses, entries; rank 0), by phase:", ""]
    lines += [f"- {n}: " + (", ".join(f"{k} {c:.1f}" for k, c in m["per_step"].items()) if m["per_step"]
                            else m.get("unavailable", "none")) for n, m in result["misses"].items()]
    lines += ["", "Still reachable after those steps that was not before them (objects the collector tracks, a step):", ""]
    lines += [f"- {n}: {g['grown']:.1f} objects" + (": " + ", ".join(f"{k} {v:.1f}" for k, v in g["grown_types"].items())
                                                       if g["grown_types"] else "") for n, g in result["garbage"].items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=FSDP_PRESETS["cpu"]["batch"])
    ap.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="foreach", help=OPTIMIZERS_HELP)
    args = ap.parse_args(argv)
    if args.device != "cpu":
        print("fsdp_twin_phases: CPU (gloo) only: the gap it looks for was measured on the 16 cores", file=sys.stderr)
        return 2
    gpt = dict(SMOKE_GPT) if args.smoke else dict(FSDP_PRESETS["cpu"]["gpt"])  # fsdp_overlap.py's CPU GPT
    if args.smoke:
        args.rounds, args.warmup = 2, 1
    world = world_size(args)
    per_rank = run_ranks(_rank_body, world, gpt, args.batch, args.rounds, args.warmup, args.threads, args.optimizer,
                         timeout_s=600.0, on_message=print_message)
    result = dict(device=device_label(args.device), gpt=gpt, args=dict(world=world, threads=args.threads,
                                                                        rounds=args.rounds, batch=args.batch,
                                                                        optimizer=args.optimizer),
                  **_summary(per_rank))
    for row in result["rows"].values():
        row.pop("steps")
    stem = (f"fsdp_twin_phases_{args.device}_ws{world}" + ("_single" if args.optimizer == "single" else "")
            + ("_smoke" if args.smoke else ""))
    write_results(result, os.path.join(out_dir(args), stem), _markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
