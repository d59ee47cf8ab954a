"""MoE layer step time, side by side in one run: chunks 1 (sequential dispatch, experts, combine),
2, 4 and 8 (the all-to-alls of neighbouring chunks in flight under each chunk's experts), under
uniform and skewed routing; and, on one GPU, the layer beside a plain MLP with the same active
parameters (its fixed cost: routing, permutation, per-expert GEMMs, the split-size sync).

Variants take turns round by round (the order rotates), so load that comes and goes on a
shared machine hits them alike. A step's time is the slowest rank's; tables give medians.
Exposed all-to-all comes from the timeline recorder (the union of ep_dispatch and ep_combine
spans not covered by expert compute; the layer has no other communication), in extra recorded steps after the timed ones. "hidden %" is the recorder's
overlap of the all-to-alls; "removed vs 1" is the share of chunks=1's exposed all-to-all that
this chunk count no longer exposes.

    python benchmarks/ep_overlap.py --world 2 --threads 1        # CPU, gloo
    python benchmarks/ep_overlap.py --world 8 --threads 2        # the GPU machine's 16 cores, gloo
    python benchmarks/ep_overlap.py --device cuda --world 1      # one GPU: fixed cost vs a plain MLP

Writes benchmarks/results/ep_overlap_<device>_ws<N>.json and .md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from _common import add_common_args, backend, device_label, line_up, world_size, write_results
from overlapkit.expert_parallel import MoE
from overlapkit.launch import spawn
from overlapkit.timeline import record
from overlapkit.timeline.report import load_imbalance, measure

PRESETS = {
    # Per rank 1024 tokens x top-2 = 2048 rows of 256 floats (2 MiB each way per layer): expert
    # GEMMs take tens of ms on one CPU thread, the gloo all-to-all a few ms.
    "cpu": dict(hidden=256, ffn_hidden=512, experts_per_rank=2, top_k=2, tokens=1024, dtype="float32"),
    "cuda": dict(hidden=2048, ffn_hidden=1408, experts_per_rank=8, top_k=2, tokens=8192, dtype="bfloat16"),
}
CHUNKS = (1, 2, 4, 8)
ROUTINGS = ("uniform", "skewed")


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


def _rank_body(device_type: str, preset: dict, steps: int, warmup: int, recorded: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    rank, ws = dist.get_rank(), dist.get_world_size()
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    dtype = getattr(torch, preset["dtype"])
    h, f, k, tokens = preset["hidden"], preset["ffn_hidden"], preset["top_k"], preset["tokens"]
    experts = preset["experts_per_rank"] * ws if device_type == "cpu" else preset["experts_per_rank"]
    layers, inputs = {}, {}
    for routing in ROUTINGS:
        x, gate = _inputs(routing, tokens, h, experts, rank, dtype, device)
        for c in CHUNKS:
            torch.manual_seed(0)
            moe = MoE(h, f, experts, k, dist.group.WORLD, chunks=c, name="moe", device=device, dtype=dtype)
            with torch.no_grad():
                moe.router.gate.weight.copy_(gate)
            layers[(routing, c)], inputs[(routing, c)] = moe, x
    if ws == 1:  # the same active parameters per token: top_k experts' worth of inner width
        layers[("plain MLP", k * f)] = _plain_mlp(h, k * f, device, dtype)
        inputs[("plain MLP", k * f)] = inputs[("uniform", 1)]
    names = list(layers)
    dy = torch.randn(tokens, h, generator=torch.Generator().manual_seed(5)).to(device, dtype)

    def run(name, backward: bool):
        x = inputs[name].detach().requires_grad_(backward)
        out = layers[name](x)
        if backward:
            out.backward(dy)

    times = {(n, mode): [] for n in names for mode in ("fwd", "fwd+bwd")}
    for i in range(warmup + steps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            for mode in ("fwd", "fwd+bwd"):
                line_up(device)
                t0 = time.perf_counter()
                with torch.no_grad() if mode == "fwd" else torch.enable_grad():
                    run(name, mode == "fwd+bwd")
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i >= warmup:
                    times[(name, mode)].append((time.perf_counter() - t0) * 1e3)
                layers[name].zero_grad(set_to_none=True)

    rec_rows, loads = {}, {}
    moes = [n for n in names if n[0] in ROUTINGS]
    with record(device=device) as rec:
        for _ in range(recorded):
            for name in moes:
                line_up(device)
                rec.next_step()
                rec_rows.setdefault(name, []).append(rec.step)
                run(name, True)
                layers[name].zero_grad(set_to_none=True)
                loads[name] = layers[name].last_load
    by_step: dict[int, list] = {}
    for s in rec.spans:
        by_step.setdefault(s.step, []).append(s)
    recorded_rows = {}
    for name, ks in rec_rows.items():
        per = []
        for step in ks:
            spans = by_step.get(step, [])
            t = measure(spans)
            chunk_compute = [s.duration_ms for s in spans if ".experts[" in s.name]
            chunk_comm = [s.duration_ms for s in spans if ".dispatch[" in s.name or ".combine[" in s.name]
            per.append(dict(exposed_ms=t.exposed_comm_ms,
                            comm_ms=t.comm_ms, hidden_ms=t.hidden_ms,
                            chunk_compute_ms=statistics.mean(chunk_compute) if chunk_compute else 0.0,
                            chunk_transfer_ms=statistics.mean(chunk_comm) if chunk_comm else 0.0))
        recorded_rows[name] = per
    return dict(times={f"{n[0]}|{n[1]}|{m}": v for (n, m), v in times.items()},
                recorded={f"{n[0]}|{n[1]}": v for n, v in recorded_rows.items()},
                loads={f"{n[0]}|{n[1]}": (l.received_per_expert, l.dropped) for n, l in loads.items()},
                experts=experts)


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def summarize(per_rank: list[dict]) -> list[dict]:
    keys = sorted({k.rsplit("|", 1)[0] for k in per_rank[0]["times"]}, key=lambda k: (k.split("|")[0] not in ROUTINGS, k))
    slowest = {k: [max(r["times"][k][i] for r in per_rank) for i in range(len(per_rank[0]["times"][k]))]
               for k in per_rank[0]["times"]}
    rows = []
    for key in keys:
        routing, c = key.split("|")
        row = dict(variant=routing, chunks=int(c) if routing in ROUTINGS else None,
                   fwd_ms=_median(slowest[key + "|fwd"]), step_ms=_median(slowest[key + "|fwd+bwd"]))
        base = f"{routing}|1" if routing in ROUTINGS else "uniform|1"
        row["step_vs_chunks1"] = _median([a / b for a, b in zip(slowest[key + "|fwd+bwd"], slowest[base + "|fwd+bwd"])])
        recs = [t for r in per_rank for t in r["recorded"].get(key, [])]
        for field in ("exposed_ms", "comm_ms", "hidden_ms", "chunk_compute_ms", "chunk_transfer_ms"):
            row[field] = _median([t[field] for t in recs]) if recs else None
        row["hidden_pct"] = 100 * row["hidden_ms"] / row["comm_ms"] if recs and row["comm_ms"] else None
        if key in per_rank[0]["loads"]:
            load = load_imbalance([r["loads"][key][0] for r in per_rank], sum(r["loads"][key][1] for r in per_rank))
            row["load"] = dict(per_rank=load.per_rank, expert_max_over_mean=load.expert_max_over_mean,
                               rank_max_over_mean=load.rank_max_over_mean)
        rows.append(row)
    for row in rows:  # share of the sequential run's exposed all-to-all this chunk count hides
        if row["chunks"] is not None:
            base = next(r for r in rows if r["variant"] == row["variant"] and r["chunks"] == 1)
            row["removed_vs_1_pct"] = (100 * (1 - row["exposed_ms"] / base["exposed_ms"])
                                       if base["exposed_ms"] else None)
    return rows


def markdown(result: dict) -> str:
    p = result["preset"]
    head = (f"MoE layer, {result['device']}, world size {result['world']} (EP {result['world']}), "
            f"{result['threads']} thread(s) a rank, torch {result['torch']}: hidden {p['hidden']}, expert ffn "
            f"{p['ffn_hidden']}, {result['experts']} experts, top-{p['top_k']}, {p['tokens']} tokens a rank, "
            f"{p['dtype']}. Median of {result['steps']} rounds (slowest rank); exposed all-to-all, hidden % and per-chunk "
            "times from the recorder (medians over ranks and recorded steps).\n\n")
    lines = ["| routing | chunks | fwd ms | fwd+bwd ms | vs chunks=1 | exposed a2a ms | a2a ms | hidden % | "
             "removed vs 1 % | experts/chunk ms | transfer/chunk ms | rank load max/mean |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    fmt = lambda v, spec: "—" if v is None else format(v, spec)  # noqa: E731
    for r in result["rows"]:
        load = r.get("load", {})
        lines.append(f"| {r['variant']} | {fmt(r['chunks'], 'd')} | {r['fwd_ms']:.2f} | {r['step_ms']:.2f} | "
                     f"{r['step_vs_chunks1']:.3f} | {fmt(r['exposed_ms'], '.2f')} | {fmt(r['comm_ms'], '.2f')} | "
                     f"{fmt(r['hidden_pct'], '.0f')} | {fmt(r.get('removed_vs_1_pct'), '.0f')} | "
                     f"{fmt(r['chunk_compute_ms'], '.2f')} | {fmt(r['chunk_transfer_ms'], '.2f')} | "
                     f"{fmt(load.get('rank_max_over_mean'), '.2f')} |")
    tail = ""
    mlp = next((r for r in result["rows"] if r["variant"] == "plain MLP"), None)
    if mlp is not None:
        moe = next(r for r in result["rows"] if r["variant"] == "uniform" and r["chunks"] == 1)
        tail = (f"\nFixed cost of the MoE layer (uniform, chunks=1, no transfer at world size 1) over a plain MLP of "
                f"inner width top_k x ffn (the same active parameters): fwd {moe['fwd_ms'] - mlp['fwd_ms']:+.2f} ms "
                f"(x{moe['fwd_ms'] / mlp['fwd_ms']:.2f}), fwd+bwd {moe['step_ms'] - mlp['step_ms']:+.2f} ms "
                f"(x{moe['step_ms'] / mlp['step_ms']:.2f}).\n")
    return head + "\n".join(lines) + "\n" + tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument("--threads", type=int, default=1, help="torch threads a rank")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--recorded", type=int, default=2, help="extra recorded fwd+bwd steps per MoE variant")
    ap.add_argument("--tokens", type=int, default=None, help="tokens a rank (default: the preset's)")
    args = ap.parse_args(argv)
    world = world_size(args)
    if world is None:
        return 2
    preset = dict(PRESETS[args.device])
    if args.tokens:
        preset["tokens"] = args.tokens
    per_rank = spawn(_rank_body, world, args.device, preset, args.steps, args.warmup, args.recorded, args.threads,
                     backend=backend(args.device), timeout_s=600.0)
    result = dict(device=device_label(args.device), world=world, threads=args.threads, torch=torch.__version__,
                  preset=preset, steps=args.steps, experts=per_rank[0]["experts"], rows=summarize(per_rank))
    tag = f"_t{preset['tokens']}" if preset["tokens"] != PRESETS[args.device]["tokens"] else ""
    write_results(result, os.path.join(args.out, f"ep_overlap_{args.device}_ws{world}{tag}"), markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
