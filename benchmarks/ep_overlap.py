"""MoE layer step time, side by side in one run: the default chunks="auto" (decided on its first calls),
each fixed chunk count 1 (no overlap: dispatch, experts, combine), 2, 4, 8, under uniform and skewed
routing; a capacity factor through the exact-count path (one host sync) and the padded path (none);
and, on one GPU, a plain MLP with the same active parameters (the layer's fixed cost).

Variants take turns round by round in a balanced order, so load that comes and goes hits them alike; a
step's time is the slowest rank's. Ratios are per round (medians and middle half, p25-p75): auto against
the best fixed count, against chunks=1 and against its own twin (the same count fixed: a gap there would
be something auto left running). Recorded steps after the timed ones give, per variant, the exposed
all-to-all (ep_dispatch + ep_combine not covered by expert compute), the all-to-all and expert time per
step, and what is neither ("rest": routing, plan, gathers, the host) — so a chunked step that does not
pay says why: its experts got slower (contention), its transfers got longer (latency per chunk), or its
rest grew (per-chunk host work).

    python benchmarks/ep_overlap.py --world 4 --threads 2        # CPU, gloo (the GPU machine's 16 cores)
    python benchmarks/ep_overlap.py --device cuda --world 1      # one GPU: fixed cost vs a plain MLP

Writes benchmarks/results/ep_overlap_<device>_ws<N>[_t<tokens>].json and .md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from _lib.common import add_common_args, device_label, line_up, out_dir, run_ranks, time_variants, world_size, write_results
from _lib.ops import layer_ops
from _lib.ratios import per_round, text, verdict
from _lib.unexported import load_imbalance, measure
from overlapkit.expert_parallel import MoE
from overlapkit.timeline import record

PRESETS = {
    # Per rank 1024 tokens x top-2 = 2048 rows of 256 floats (2 MiB each way per layer): expert
    # GEMMs take tens of ms on one CPU thread, the gloo all-to-all a few ms.
    "cpu": dict(hidden=256, ffn_hidden=512, experts_per_rank=2, top_k=2, tokens=1024, dtype="float32",
                capacity_factor=1.25),
    "cuda": dict(hidden=2048, ffn_hidden=1408, experts_per_rank=8, top_k=2, tokens=8192, dtype="bfloat16",
                 capacity_factor=1.25),
}
FIXED = (1, "ranks", 2, 4, 8)
"""The fixed settings (chunks="ranks": a chunk per source rank; the same as 1 on one rank, so left out there)."""
ROUTINGS = ("uniform", "skewed")
MLP = "plain MLP"
GRAPHED = "uniform chunks=1, CUDA graph"
SECOND = "uniform chunks=1, a second instance"
CAPACITY = ("capacity exact", "capacity padded")
"""Uniform routing with the preset's capacity factor at chunks=1: exact counts (a host sync) vs padded (none)."""


def _inputs(routing: str, tokens: int, hidden: int, experts: int, rank: int, dtype, device):
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(tokens, hidden, generator=g)
    gate = torch.randn(experts, hidden, generator=torch.Generator().manual_seed(7)) * hidden ** -0.5
    if routing == "skewed":  # about 3/4 of the first choices go to expert 0, the last expert gets ~none
        d = torch.nn.functional.normalize(torch.randn(hidden, generator=torch.Generator().manual_seed(8)), dim=0)
        x = x + 1.5 * d * hidden ** 0.5 / 8
        gate[0], gate[-1] = 3 * d, -3 * d
    return x.to(device, dtype), gate.to(device, dtype)


def _plain_mlp(hidden: int, inner: int, device, dtype):
    return torch.nn.Sequential(torch.nn.Linear(hidden, inner), torch.nn.GELU(), torch.nn.Linear(inner, hidden)).to(device, dtype)


def _fixed(ws: int) -> tuple:
    return FIXED if ws > 1 else tuple(c for c in FIXED if c != "ranks")


def _layers(p: dict, ws: int, rank: int, device, dtype):
    """{variant: (layer, input)}; every MoE starts from the same weights."""
    h, f, k, tokens = p["hidden"], p["ffn_hidden"], p["top_k"], p["tokens"]
    experts = p["experts_per_rank"] * ws if device.type == "cpu" else p["experts_per_rank"]
    out = {}

    def moe(routing, chunks, **kw):
        x, gate = _inputs(routing, tokens, h, experts, rank, dtype, device)
        torch.manual_seed(0)
        layer = MoE(h, f, experts, k, dist.group.WORLD, chunks=chunks, name="moe", device=device, dtype=dtype, **kw)
        with torch.no_grad():
            layer.router.gate.weight.copy_(gate)
        return layer, x

    for routing in ROUTINGS:
        out[f"{routing} auto"] = moe(routing, "auto")
        for c in _fixed(ws):
            out[f"{routing} chunks={c}"] = moe(routing, c)
    # A second instance of chunks=1: beside it, "auto vs its twin" has a noise floor (two identical layers).
    out[SECOND] = moe("uniform", 1)
    for name, pad in zip(CAPACITY, (False, True)):
        out[name] = moe("uniform", 1, capacity_factor=p["capacity_factor"], pad_to_capacity=pad)
    if ws == 1:  # the same active parameters per token: top_k experts' worth of inner width
        out[MLP] = (_plain_mlp(h, k * f, device, dtype), out["uniform chunks=1"][1])
    if ws == 1 and device.type == "cuda":
        # The dropless path reads nothing to the host at one rank, so its forward and backward can be
        # captured once and replayed: what the fixed cost is without the host's ~50 dispatches a call.
        layer, x = moe("uniform", 1)
        try:
            out[GRAPHED] = (torch.cuda.make_graphed_callables(layer, (x.detach().requires_grad_(True),)), x)
        except Exception as e:  # noqa: BLE001 (reported in the table, the other rows still run)
            print(f"ep_overlap: {GRAPHED} cannot be captured: {type(e).__name__}: {e}", file=sys.stderr)
    return out, experts


def _rank_body(device_type: str, p: dict, steps: int, warmup: int, recorded: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    rank, ws = dist.get_rank(), dist.get_world_size()
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    dtype = getattr(torch, p["dtype"])
    layers, experts = _layers(p, ws, rank, device, dtype)
    dy = torch.randn(p["tokens"], p["hidden"], generator=torch.Generator().manual_seed(5)).to(device, dtype)

    def run(name: str, backward: bool) -> None:
        layer, x = layers[name]
        x = x.detach().requires_grad_(backward)
        with torch.enable_grad() if backward else torch.no_grad():
            out = layer(x)
            if backward:
                out.backward(dy)
        layer.zero_grad(set_to_none=True)

    # auto decides on its first calls (training steps here): run them before anything is timed.
    auto = {}
    for name in (n for n in layers if n.endswith(" auto")):
        t0, calls = time.perf_counter(), 0
        while layers[name][0].chunks is None:
            run(name, True)
            calls += 1
        c = layers[name][0].chunk_choice
        auto[name] = dict(chunks=c.decided, reason=c.reason, calls=calls, seconds=time.perf_counter() - t0)

    names = [f"{n}|{m}" for n in layers for m in ("fwd", "fwd+bwd")]
    mine = time_variants(lambda v: run(v.split("|")[0], v.endswith("fwd+bwd")), names, steps, warmup, device)
    times = {}
    for v, ms in mine.items():  # a step takes as long as its slowest rank
        t = torch.tensor(ms, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times[v] = t.tolist()

    recorded_rows, loads = {}, {}
    # Aten ops a call dispatches (each a dispatch, most a kernel launch): what a host-bound layer pays for.
    ops = {name: layer_ops(layer, x, dy) for name, (layer, x) in layers.items()}
    for name, (layer, _) in layers.items():
        if name == MLP:
            continue
        per = []
        for _ in range(recorded):
            line_up(device)
            with record(device=device) as rec:
                t0 = time.perf_counter()
                run(name, True)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                wall = (time.perf_counter() - t0) * 1e3
            t = measure(rec.spans)
            experts_ms = sum(s.duration_ms for s in rec.spans if ".experts[" in s.name)
            chunk_compute = [s.duration_ms for s in rec.spans if ".experts[" in s.name]
            chunk_comm = [s.duration_ms for s in rec.spans if ".dispatch[" in s.name or ".combine[" in s.name]
            per.append(dict(wall_ms=wall, exposed_ms=t.exposed_comm_ms, comm_ms=t.comm_ms, hidden_ms=t.hidden_ms,
                            experts_ms=experts_ms, rest_ms=wall - experts_ms - t.exposed_comm_ms,
                            chunk_compute_ms=statistics.mean(chunk_compute) if chunk_compute else 0.0,
                            chunk_transfer_ms=statistics.mean(chunk_comm) if chunk_comm else 0.0))
        recorded_rows[name] = per
        load = layer.last_load
        loads[name] = (load.received_per_expert, load.dropped)
    return dict(times=times, recorded=recorded_rows, loads=loads, experts=experts, auto=auto, ops=ops)


def _median(xs):
    return statistics.median(xs) if xs else None


def summarize(per_rank: list[dict]) -> dict:
    times = per_rank[0]["times"]  # already the slowest rank's, round by round
    fixed = _fixed(len(per_rank))
    step = {n.split("|")[0]: ms for n, ms in times.items() if n.endswith("|fwd+bwd")}
    fwd = {n.split("|")[0]: ms for n, ms in times.items() if n.endswith("|fwd")}
    rows = []
    for name in step:
        row = dict(variant=name, fwd_ms=_median(fwd[name]), step_ms=_median(step[name]), ops=per_rank[0]["ops"][name])
        recs = [t for r in per_rank for t in r["recorded"].get(name, [])]
        for field in ("wall_ms", "exposed_ms", "comm_ms", "hidden_ms", "experts_ms", "rest_ms", "chunk_compute_ms",
                      "chunk_transfer_ms"):
            row[field] = _median([t[field] for t in recs]) if recs else None
        row["hidden_pct"] = 100 * row["hidden_ms"] / row["comm_ms"] if recs and row["comm_ms"] else None
        if name in per_rank[0]["loads"]:
            load = load_imbalance([r["loads"][name][0] for r in per_rank], sum(r["loads"][name][1] for r in per_rank))
            row["rank_load_max_over_mean"] = load.rank_max_over_mean
        routing = name.split(" ")[0]
        if routing in ROUTINGS and name != f"{routing} chunks=1":
            row["vs_chunks1"] = per_round(step[name], step[f"{routing} chunks=1"])
        rows.append(row)
    by = {r["variant"]: r for r in rows}
    for r in rows:  # share of the sequential run's exposed all-to-all this variant no longer exposes
        routing = r["variant"].split(" ")[0]
        base = by.get(f"{routing} chunks=1")
        if base and base["exposed_ms"] and r["exposed_ms"] is not None:
            r["removed_vs_1_pct"] = 100 * (1 - r["exposed_ms"] / base["exposed_ms"])
    autos = {}
    for routing in ROUTINGS:
        name = f"{routing} auto"
        decided = per_rank[0]["auto"][name]
        best = min(fixed, key=lambda c: by[f"{routing} chunks={c}"]["step_ms"])
        chunked = min(fixed[1:], key=lambda c: by[f"{routing} chunks={c}"]["step_ms"])
        cb = by[f"{routing} chunks={chunked}"]
        autos[routing] = dict(
            **decided, best_fixed=best, best_chunked=chunked,
            vs_best_fixed=per_round(step[name], step[f"{routing} chunks={best}"]),
            vs_chunks1=per_round(step[name], step[f"{routing} chunks=1"]),
            vs_twin=per_round(step[name], step[f"{routing} chunks={decided['chunks']}"]),
            chunked_vs_1=per_round(step[f"{routing} chunks={chunked}"], step[f"{routing} chunks=1"]),
            experts_longer_than_transfer=(cb["chunk_compute_ms"] or 0) > (cb["chunk_transfer_ms"] or 0))
    out = dict(rows=rows, auto=autos,
               capacity_padded_vs_exact=per_round(step[CAPACITY[1]], step[CAPACITY[0]]),
               capacity_padded_vs_exact_fwd=per_round(fwd[CAPACITY[1]], fwd[CAPACITY[0]]))
    if MLP in step:
        out["fixed_cost"] = {name: dict(fwd=per_round(fwd[name], fwd[MLP]), step=per_round(step[name], step[MLP]))
                             for name in ("uniform chunks=1", *CAPACITY, "uniform auto", GRAPHED) if name in step}
    return out


def _ops(o: dict) -> str:
    return f"{o['ops']} ({o['kernels']})"


def markdown(result: dict) -> str:
    p, s = result["preset"], result["summary"]
    fmt = lambda v, spec=".2f": "—" if v is None else format(v, spec)  # noqa: E731
    head = (f"MoE layer, {result['device']}, world size {result['world']} (EP {result['world']}), "
            f"{result['threads']} thread(s) a rank, torch {result['torch']}: hidden {p['hidden']}, expert ffn "
            f"{p['ffn_hidden']}, {result['experts']} experts, top-{p['top_k']}, {p['tokens']} tokens a rank, "
            f"{p['dtype']}; capacity variants at factor {p['capacity_factor']}, chunks=1. Medians of "
            f"{result['steps']} rounds (slowest rank); per-round ratios with their middle half; exposed all-to-all, "
            "expert time and per-chunk times from the recorder (medians over ranks and recorded steps); ops: aten ops "
            "rank 0 dispatched in one forward (no grad) and one backward, in brackets those that are not views or "
            "allocations (on a GPU, each a kernel launch).\n\n")
    lines = ["| variant | fwd ms | fwd+bwd ms | vs chunks=1 (per round) | exposed a2a ms | a2a ms | hidden % | "
             "removed vs 1 % | experts ms | rest ms | experts/chunk ms | transfer/chunk ms | rank load max/mean | "
             "ops fwd (kernels) | ops bwd (kernels) |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in s["rows"]:
        lines.append(f"| {r['variant']} | {fmt(r['fwd_ms'])} | {fmt(r['step_ms'])} | {text(r.get('vs_chunks1'))} | "
                     f"{fmt(r['exposed_ms'])} | {fmt(r['comm_ms'])} | {fmt(r['hidden_pct'], '.0f')} | "
                     f"{fmt(r.get('removed_vs_1_pct'), '.0f')} | {fmt(r['experts_ms'])} | {fmt(r['rest_ms'])} | "
                     f"{fmt(r['chunk_compute_ms'])} | {fmt(r['chunk_transfer_ms'])} | "
                     f"{fmt(r.get('rank_load_max_over_mean'))} | {_ops(r['ops']['fwd'])} | {_ops(r['ops']['bwd'])} |")
    lines += ["", "| routing | auto kept | trial calls (s) | auto vs best fixed | auto vs chunks=1 | auto vs its twin | "
              "best chunked vs chunks=1 | targets |", "|---|---|---:|---|---|---|---|---|"]
    for routing, a in s["auto"].items():
        t1 = verdict(a["vs_best_fixed"], 1.01)
        t2 = verdict(a["vs_chunks1"], 1.01)
        t3 = (verdict(a["chunked_vs_1"], 0.85) if a["experts_longer_than_transfer"]
              else "n/a (a chunk's experts not longer than its transfer)") if routing == "uniform" else "—"
        lines.append(f"| {routing} | {a['chunks']} | {a['calls']} ({a['seconds']:.1f}) | {text(a['vs_best_fixed'])} | "
                     f"{text(a['vs_chunks1'])} | {text(a['vs_twin'])} | {a['best_chunked']}: {text(a['chunked_vs_1'])} | "
                     f"auto ≤ 1.01× best fixed: {t1}; ≤ 1.01× chunks=1: {t2}; chunked ≤ 0.85×: {t3} |")
    lines += ["", "auto's decisions: " + "; ".join(f"{r}: {a['reason']}" for r, a in s["auto"].items()), "",
              f"Capacity padded (no host sync) vs exact counts (one host sync), per round: fwd+bwd "
              f"{text(s['capacity_padded_vs_exact'])}, fwd {text(s['capacity_padded_vs_exact_fwd'])}."]
    if "fixed_cost" in s:
        lines += ["", "Fixed cost over a plain MLP of inner width top_k x ffn (the same active parameters; nothing is "
                  "transferred at world size 1), per round (target ≤ 2×):", "",
                  "| MoE variant | fwd | fwd verdict | fwd+bwd | fwd+bwd verdict | ops fwd / bwd (kernels) |",
                  "|---|---|---|---|---|---|"]
        by = {r["variant"]: r for r in s["rows"]}
        for name, fc in [*s["fixed_cost"].items(), (MLP, None)]:
            o = by[name]["ops"]
            ratios = "| — | — | — | —" if fc is None else (f"| {text(fc['fwd'])} | {verdict(fc['fwd'], 2.0)} | "
                                                            f"{text(fc['step'])} | {verdict(fc['step'], 2.0)}")
            lines.append(f"| {name} {ratios} | {_ops(o['fwd'])} / {_ops(o['bwd'])} |")
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument("--threads", type=int, default=1, help="torch threads a rank")
    ap.add_argument("--steps", type=int, default=8, help="timed rounds")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    ap.add_argument("--recorded", type=int, default=2, help="recorded fwd+bwd steps per variant")
    ap.add_argument("--tokens", type=int, default=None, help="tokens a rank (default: the preset's)")
    ap.add_argument("--hidden", type=int, default=None, help="model width (default: the preset's)")
    ap.add_argument("--ffn", type=int, default=None, help="expert inner width (default: the preset's)")
    args = ap.parse_args(argv)
    if args.smoke:  # 64 tokens of width 32 a rank, two rounds after one, one recorded step
        args.tokens, args.hidden, args.ffn = args.tokens or 64, args.hidden or 32, args.ffn or 64
        args.steps, args.warmup, args.recorded = 2, 1, 1
    world = world_size(args)
    if world is None:
        return 2
    preset = dict(PRESETS[args.device])
    for key, value in (("tokens", args.tokens), ("hidden", args.hidden), ("ffn_hidden", args.ffn)):
        if value:
            preset[key] = value
    per_rank = run_ranks(_rank_body, world, args.device, preset, args.steps, args.warmup, args.recorded, args.threads,
                         device=args.device, timeout_s=600.0)
    result = dict(device=device_label(args.device), world=world, threads=args.threads, torch=torch.__version__,
                  preset=preset, steps=args.steps, experts=per_rank[0]["experts"], summary=summarize(per_rank),
                  times=per_rank[0]["times"])
    base = PRESETS[args.device]
    tag = "".join(f"_{k[0]}{preset[k]}" for k in ("tokens", "hidden", "ffn_hidden") if preset[k] != base[k])
    write_results(result, os.path.join(out_dir(args), f"ep_overlap_{args.device}_ws{world}{tag}"), markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
