"""Context-parallel attention, side by side in one run: the default overlap="auto" (decided on its first
calls), "pipelined" (the ring: the next K/V block in flight while this one's attention runs), "bulk" (the
all-gather schedule: every block sent to every rank at the start of the pass, each attended as it lands),
"none" (every transfer after its block: no overlap), and PyTorch's context_parallel where it runs; forward
and forward+backward; per-round ratios; exposed cp_kv from the timeline recorder, and why it waits.

Variants take turns round by round (each round in the next order of a balanced design), so load that
comes and goes hits them alike; a call's time is the slowest rank's. Ratios are per round (median and
middle half). Exposed cp_kv comes from recorded calls after the timed ones: the cp_kv time not covered by
a block's attention, as a share of the transfer (a hop timed alone — ranks lined up, the ring's exchange
and nothing else — times the hops of the phase). Target: <= 20 % exposed where a block's attention is
longer than its hop. The waits are attributed from every rank's spans (_lib/cp_waits.py): the sending rank
posted late, a hop is longer than the block even alone, or the transfer ran slower than alone (under
"bulk" several blocks share the link at once, which counts there too); beside it the blocks' time
overlapped vs sequential (contention), the merge's share and the ranks' compute spread.

At world size 1 on CUDA there is no ring to overlap: auto keeps "none" without trials, and the run
measures the ring's fixed cost (one block of the fused kernel, the log-sum-exp bookkeeping) against
`scaled_dot_product_attention` on the whole sequence and PyTorch's experimental `context_parallel` at a
mesh of one. (PyTorch's context_parallel does not run on CPU: it has no ring for
`_scaled_dot_product_flash_attention_for_cpu`; the CPU run records its error.)

    python benchmarks/cp_overlap.py --world 4 --threads 3          # CPU, gloo (the GPU machine's 16 cores)
    python benchmarks/cp_overlap.py --device cuda --world 1        # one GPU: fixed cost vs SDPA
    python benchmarks/cp_overlap.py --device cuda --world 8        # 8 GPUs, NCCL: the ring and torch's, side by side

Writes benchmarks/results/cp_overlap_<device>_ws<N>[_s<tokens a rank>].json and .md.
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
import torch.nn.functional as F

from _lib.common import add_common_args, device_label, line_up, out_dir, run_ranks, time_variants, world_size, write_results
from _lib.cp_waits import attribute, rank_spans
from _lib.ratios import per_round, text, verdict
from _lib.unexported import comm, measure
from overlapkit.context_parallel import AUTO_CANDIDATES, ContextParallelConfig, RingAttention, shard
from overlapkit.timeline import record

PRESETS = {
    # One block (512 queries against 256 keys, 4 heads of 64) takes a few ms on one CPU thread while
    # its 0.5 MiB of K/V crosses gloo's loopback in well under one: the regime the target speaks of.
    "cpu": dict(batch=1, heads=4, kv_heads=4, head_dim=64, seq_per_rank=512, dtype="float32"),
    "cuda": dict(batch=1, heads=32, kv_heads=8, head_dim=128, seq_per_rank=8192, dtype="bfloat16"),
}
CUDA_WS1_SEQS = (4096, 16384, 32768)
"""Whole-sequence lengths of the world-size-1 fixed-cost table."""
FIXED = AUTO_CANDIDATES
"""The fixed overlap settings auto chooses among: pipelined (the ring), bulk (all-gather), none."""


def variants(world: int) -> list[str]:
    """auto, the fixed settings, and bulk with fewer blocks in flight than all P−1 ("bulk prefetch=N")."""
    return ["auto", *FIXED] + [f"bulk prefetch={d}" for d in (1, 2) if d < world - 1]


def config_of(name: str) -> ContextParallelConfig:
    overlap, _, prefetch = name.partition(" prefetch=")
    return ContextParallelConfig(overlap=overlap, prefetch=int(prefetch) if prefetch else None)
TARGET = 20.0
"""Exposed cp_kv, % of the transfer, where a block's attention is longer than its hop."""


def _median(xs):
    return statistics.median(xs) if xs else None


def _time_calls(calls: dict, rounds: int, warmup: int, device) -> dict[str, list[float]]:
    """ms of each call per round, the slowest rank's (a call takes as long as its slowest rank)."""
    mine = time_variants(lambda name: calls[name](), list(calls), rounds, warmup, device)
    times = {}
    for name, ms in mine.items():
        t = torch.tensor(ms, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times[name] = t.tolist()
    return times


def _inputs(p: dict, seq: int, device, seed: int = 0):
    dtype = getattr(torch, p["dtype"])
    g = torch.Generator(device=device).manual_seed(seed)
    shape = lambda h: (p["batch"], h, seq, p["head_dim"])  # noqa: E731
    return [torch.randn(shape(h), generator=g, device=device, dtype=dtype) for h in (p["heads"], p["kv_heads"], p["kv_heads"])]


def _ring_body(device_type: str, p: dict, rounds: int, warmup: int, recorded: int, threads: int) -> dict:
    """Every rank: let auto decide, time every variant, then record them for exposed cp_kv and its causes."""
    torch.set_num_threads(threads)
    rank, size = dist.get_rank(), dist.get_world_size()
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    full = _inputs(p, p["seq_per_rank"] * size, device)
    q, k, v = (shard(t, 2, rank, size, "zigzag") for t in full)
    dout = torch.randn_like(q)
    group = dist.group.WORLD
    names = variants(size)
    rings = {name: RingAttention(group, config_of(name)) for name in names}

    def call(name: str, backward: bool):
        def run():
            if not backward:
                with torch.no_grad():
                    rings[name](q, k, v)
                return
            ql, kl, vl = (t.detach().requires_grad_() for t in (q, k, v))
            rings[name](ql, kl, vl).backward(dout)
        return run

    t0, trial_calls = time.perf_counter(), 0
    while True:  # auto decides on its first calls (fwd+bwd here), before anything is timed
        call("auto", True)()
        trial_calls += 1
        (choice,) = rings["auto"].overlap_choices.choices().values()
        if choice.decided is not None:
            break
    auto = dict(overlap=choice.decided, reason=choice.reason, calls=trial_calls, seconds=time.perf_counter() - t0)
    calls = {f"{o} {'fwd+bwd' if b else 'fwd'}": call(o, b) for o in names for b in (False, True)}
    torch_cp = _torch_cp_call(full, dout, device, size, rank)
    if callable(torch_cp):
        calls["torch context_parallel fwd+bwd"] = torch_cp
    times = _time_calls(calls, rounds, warmup, device)

    hop_ms = {"kv": _hop_ms([k, v], device), "dkv": _hop_ms([k.float(), v.float()], device)}  # dK/dV travel in fp32
    per_mode, spans = {}, {}
    for name in names:
        with record(device=device) as rec:
            for _ in range(recorded):
                line_up(device)
                rec.next_step()
                call(name, True)()
        per_mode[name] = _exposure(rec.spans)
        spans[name] = rank_spans(rec)
    return dict(times=times, recorded=per_mode, spans=spans, hop_ms=hop_ms, auto=auto,
                torch_cp=None if callable(torch_cp) else torch_cp)


def _hop_ms(tensors, device, trials: int = 15) -> float:
    """A hop's transfer time alone: ranks line up, every rank sends these to the next and receives from the
    previous (the ring's exchange), nothing else runs; median over trials of the slowest rank."""
    rank, size = dist.get_rank(), dist.get_world_size()
    out = []
    for _ in range(trials):
        incoming = [torch.empty_like(t) for t in tensors]
        line_up(device)
        t0 = time.perf_counter()
        comm.exchange([(t, (rank + 1) % size) for t in tensors], [(t, (rank - 1) % size) for t in incoming],
                      dist.group.WORLD, kind="cp_kv", async_op=False)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = torch.tensor([(time.perf_counter() - t0) * 1e3], device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        out.append(elapsed.item())
    return statistics.median(out)


def _exposure(spans) -> dict:
    """Per phase (fwd, bwd), medians over recorded steps: cp_kv comm and exposed ms, block and hop durations."""
    out = {}
    for phase in ("fwd", "bwd"):
        mine = [s for s in spans if f".{phase}" in s.name and (s.kind == "cp_kv" or s.is_compute)]
        steps = sorted({s.step for s in mine})
        times = [measure([s for s in mine if s.step == st]) for st in steps]
        blocks = [s.duration_ms for s in mine if s.is_compute and f".{phase}[" in s.name
                  and not s.name.endswith(f"{phase}[0]") and not s.name.endswith(".merge")]
        hops = [s for s in mine if s.kind == "cp_kv"]
        n = max(len(steps), 1)
        out[phase] = dict(comm_ms=_median([t.comm_ms for t in times]), exposed_ms=_median([t.exposed_comm_ms for t in times]),
                          block_ms=_median(blocks), kv_hops=sum(".kv[" in s.name for s in hops) // n,
                          dkv_hops=sum(".dkv[" in s.name for s in hops) // n, steps=[asdict(t) for t in times])
    return out


def _torch_cp_call(full, dout, device, size: int, rank: int):
    """A fwd+bwd call of PyTorch's experimental context_parallel on the same inputs, or why it cannot run."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        try:  # the ring form (K/V rotated by all-to-all), as ours, not its all-gather default
            from torch.distributed.tensor.experimental._attention import set_rotate_method
            set_rotate_method("alltoall")
        except ImportError:
            pass
        mesh = init_device_mesh(device.type, (size,), mesh_dim_names=("cp",))
        # Its ring handles the flash/efficient/cuDNN ops, which want equal head counts: repeat K/V heads.
        groups = full[0].shape[1] // full[1].shape[1]
        full = [full[0]] + [t.repeat_interleave(groups, dim=1) for t in full[1:]]
        grad = torch.randn_like(full[0])  # whole-sequence output grad: context_parallel shards it with the rest

        def step():
            # Buffers are sharded in place on entry (and restored on exit): pass copies, make the grad leaves inside.
            bufs = [t.clone() for t in full] + [grad.clone()]
            with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2]):
                ql, kl, vl = (t.detach().requires_grad_() for t in bufs[:3])
                F.scaled_dot_product_attention(ql, kl, vl, is_causal=True).backward(bufs[3])
        step()
        return step
    except Exception as e:  # report why, never a number for something that did not run
        return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"


def _fixed_cost_body(p: dict, rounds: int, warmup: int, seqs=CUDA_WS1_SEQS, device_type: str = "cuda") -> dict:
    """World size 1 on CUDA: the ring's fixed cost vs SDPA on the whole sequence (and torch CP at a mesh of one)."""
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    rows = {}
    rings = {o: RingAttention(dist.group.WORLD, ContextParallelConfig(overlap=o)) for o in ("auto", "pipelined", "bulk")}
    for seq in seqs:
        q, k, v = _inputs(p, seq, device)
        dout = torch.randn_like(q)
        gqa = p["heads"] != p["kv_heads"]

        def sdpa(backward):
            def run():
                ql, kl, vl = (t.detach().requires_grad_(backward) for t in (q, k, v))
                o = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True, enable_gqa=gqa)
                if backward:
                    o.backward(dout)
            return run

        def ring(backward, overlap="auto"):
            def run():
                ql, kl, vl = (t.detach().requires_grad_(backward) for t in (q, k, v))
                o = rings[overlap](ql, kl, vl)
                if backward:
                    o.backward(dout)
            return run

        calls = {"sdpa fwd": sdpa(False), "sdpa fwd+bwd": sdpa(True), "ring fwd": ring(False), "ring fwd+bwd": ring(True),
                 "ring pipelined fwd+bwd": ring(True, "pipelined"), "ring bulk fwd+bwd": ring(True, "bulk")}
        torch_cp = _torch_cp_call([q, k, v], dout, device, 1, 0)
        if callable(torch_cp):
            calls["torch context_parallel fwd+bwd"] = torch_cp
        times = _time_calls(calls, rounds, warmup, device)
        ratios = {"ring vs sdpa, fwd": per_round(times["ring fwd"], times["sdpa fwd"]),
                  "ring vs sdpa": per_round(times["ring fwd+bwd"], times["sdpa fwd+bwd"]),
                  "auto vs pipelined": per_round(times["ring fwd+bwd"], times["ring pipelined fwd+bwd"]),
                  "bulk vs pipelined": per_round(times["ring bulk fwd+bwd"], times["ring pipelined fwd+bwd"])}
        if callable(torch_cp):
            ratios["ring vs torch CP"] = per_round(times["ring fwd+bwd"], times["torch context_parallel fwd+bwd"])
        rows[seq] = dict(times={n: _median(t) for n, t in times.items()}, ratios=ratios,
                         torch_cp=None if callable(torch_cp) else torch_cp)
        del q, k, v, dout
        if device.type == "cuda":
            torch.cuda.empty_cache()
    decided = {str(key[1]): (c.decided, c.reason) for key, c in rings["auto"].overlap_choices.choices().items()}
    return dict(rows=rows, auto=decided)


def summarize_ring(per_rank: list[dict]) -> dict:
    raw = per_rank[0]["times"]  # already the slowest rank's, round by round
    times = {name: _median(t) for name, t in raw.items()}
    hop = per_rank[0]["hop_ms"]  # already the slowest rank's
    auto = per_rank[0]["auto"]
    names = list(per_rank[0]["recorded"])
    best = min(names[1:], key=lambda o: times[f"{o} fwd+bwd"])
    step = lambda name: raw[f"{name} fwd+bwd"]  # noqa: E731
    ratios = {f"auto vs best fixed ({best})": per_round(step("auto"), step(best)),
              "auto vs none": per_round(step("auto"), step("none")),
              f"auto vs its twin ({auto['overlap']})": per_round(step("auto"), step(auto["overlap"])),
              "pipelined vs none": per_round(step("pipelined"), step("none")),
              "bulk vs none": per_round(step("bulk"), step("none")),
              "bulk vs pipelined": per_round(step("bulk"), step("pipelined")),
              "bulk vs pipelined, fwd": per_round(raw["bulk fwd"], raw["pipelined fwd"]),
              "auto vs none, fwd": per_round(raw["auto fwd"], raw["none fwd"])}
    for name in names:
        if "prefetch" in name:
            ratios[f"{name} vs bulk"] = per_round(step(name), step("bulk"))
    if "torch context_parallel fwd+bwd" in raw:
        ratios["auto vs torch context_parallel"] = per_round(step("auto"), raw["torch context_parallel fwd+bwd"])
    out = dict(times_ms=times, torch_cp_error=per_rank[0]["torch_cp"], auto=auto, hop_ms=hop, ratios=ratios,
               phases={}, waits={})
    for phase in ("fwd", "bwd"):
        seq = per_rank[0]["recorded"]["none"][phase]
        transfer = hop["kv"] * seq["kv_hops"] + hop["dkv"] * seq["dkv_hops"]
        block_seq = _median([r["recorded"]["none"][phase]["block_ms"] for r in per_rank])
        hop_one = hop["dkv"] if phase == "bwd" else hop["kv"]
        row = dict(transfer_ms=transfer, kv_hops=seq["kv_hops"], dkv_hops=seq["dkv_hops"], block_ms_sequential=block_seq,
                   hop_ms=hop_one, block_longer_than_hop=None if block_seq is None else block_seq > hop_one, variants={})
        for name in names:
            recs = [r["recorded"][name][phase] for r in per_rank]
            exposed = _median([x["exposed_ms"] for x in recs])
            pct = 100.0 * exposed / transfer if transfer and exposed is not None else None
            row["variants"][name] = dict(exposed_ms=exposed, exposed_pct=pct,
                                         block_ms=_median([x["block_ms"] for x in recs]),
                                         target=None if not row["block_longer_than_hop"] or pct is None else pct <= TARGET)
        out["phases"][phase] = row
    for name in names:
        schedule = per_rank[0]["auto"]["overlap"] if name == "auto" else config_of(name).overlap
        out["waits"][name] = attribute([r["spans"][name] for r in per_rank], hop, schedule=schedule)
    return out


def markdown(result: dict) -> str:
    fmt = lambda v, spec=".2f": "—" if v is None else format(v, spec)  # noqa: E731
    p = result["preset"]
    head = (f"Ring attention, {result['device']}, world size {result['world']}, torch {result['torch']}, "
            f"{result['threads']} thread(s) a rank: batch {p['batch']}, {p['heads']} query / {p['kv_heads']} K/V heads of "
            f"{p['head_dim']}, {p['dtype']}, causal, zigzag. Load average when it started: "
            f"{result.get('load_avg_before', float('nan')):.1f} on {os.cpu_count()} cores.\n\n")
    if "rows" in result:  # world size 1: fixed cost
        lines = ["The ring is the default (overlap='auto', which keeps 'none' at cp = 1 without trials); ratios per "
                 "round, median (middle half).", "",
                 "| sequence | sdpa fwd ms | ring fwd ms | ratio | sdpa fwd+bwd ms | ring fwd+bwd ms | ratio | "
                 "torch CP fwd+bwd ms | ring vs torch CP | auto vs pipelined (≤ 1.01) | bulk vs pipelined |",
                 "|---:|---:|---:|---|---:|---:|---|---:|---|---|---|"]
        for seq, row in result["rows"].items():
            t, x = row["times"], row["ratios"]
            tcp = fmt(t.get("torch context_parallel fwd+bwd")) if row["torch_cp"] is None else "cannot run"
            lines.append(f"| {seq} | {fmt(t['sdpa fwd'])} | {fmt(t['ring fwd'])} | {text(x['ring vs sdpa, fwd'])} | "
                         f"{fmt(t['sdpa fwd+bwd'])} | {fmt(t['ring fwd+bwd'])} | {text(x['ring vs sdpa'])} | {tcp} | "
                         f"{text(x.get('ring vs torch CP'))} | {text(x['auto vs pipelined'])}: "
                         f"{verdict(x['auto vs pipelined'], 1.01)} | {text(x['bulk vs pipelined'])} |")
        errs = {row["torch_cp"] for row in result["rows"].values() if row["torch_cp"]}
        lines += ["", "auto's decisions: " + "; ".join(f"q {k}: {d} ({why})" for k, (d, why) in result["auto"].items())]
        return head + "\n".join(lines) + "\n" + "".join(f"\ntorch context_parallel: {e}\n" for e in errs)
    r = result["ring"]
    t = r["times_ms"]
    a = r["auto"]
    lines = [f"sequence {p['seq_per_rank'] * result['world']} ({p['seq_per_rank']} a rank). Median ms of {result['rounds']} "
             f"rounds, slowest rank. auto kept **{a['overlap']}** after {a['calls']} calls ({a['seconds']:.1f} s): "
             f"{a['reason']}.\n", "| variant | fwd ms | fwd+bwd ms |", "|---|---:|---:|"]
    names = list(r["waits"])
    for o in names:
        lines.append(f"| ring overlap={o} | {fmt(t.get(o + ' fwd'))} | {fmt(t.get(o + ' fwd+bwd'))} |")
    tcp = t.get("torch context_parallel fwd+bwd")
    lines.append(f"| torch context_parallel | — | {fmt(tcp) if r['torch_cp_error'] is None else 'cannot run'} |")
    lines += ["", "| per-round ratio (fwd+bwd unless said) | median (middle half) | target |", "|---|---|---|"]
    for name, x in r["ratios"].items():
        goal = verdict(x, 1.01) if name.startswith("auto vs") and "torch" not in name else "—"
        lines.append(f"| {name} | {text(x)} | {'≤ 1.01: ' + goal if goal != '—' else goal} |")
    lines += ["", "Exposed cp_kv from the recorder, % of the transfer (hops alone: K/V "
              f"{fmt(r['hop_ms']['kv'])} ms, fp32 dK/dV {fmt(r['hop_ms']['dkv'])} ms):", "",
              "| phase | hops K/V + dK/dV | block ms, sequential | transfer ms | "
              + " | ".join(f"{v}: exposed ms (%), block ms" for v in names) + f" | target ≤ {TARGET:.0f} % |",
              "|---|---|---:|---:|" + "---|" * len(names) + "---|"]
    for phase, x in r["phases"].items():
        cells = [f"{fmt(v['exposed_ms'])} ({fmt(v['exposed_pct'], '.0f')} %), {fmt(v['block_ms'])}"
                 for v in x["variants"].values()]
        said = {None: "n/a (block not longer than hop)", True: "met", False: "MISSED"}
        goal = "; ".join(f"{v}: {said[x['variants'][v]['target']]}" for v in names if v != "none")
        lines.append(f"| {phase} | {x['kv_hops']} + {x['dkv_hops']} | {fmt(x['block_ms_sequential'])} | "
                     f"{fmt(x['transfer_ms'])} | " + " | ".join(cells) + f" | {goal} |")
    lines += ["", "Why it waits (_lib/cp_waits.py; ms per rank and step, medians over recorded steps): exposed = sending "
              "rank posted late + a hop alone longer than the block + the transfer slower than alone; blocks "
              "overlapped vs sequential above show contention on the compute side.", "",
              "| variant | phase | exposed | peer late | hop longer than block | slower than alone | merge ms a step "
              "| block ms | rank compute max/min |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, phases in r["waits"].items():
        for phase, w in phases.items():
            lines.append(f"| {name} | {phase} | {fmt(w.get('exposed'))} | {fmt(w.get('peer_late'))} | "
                         f"{fmt(w.get('hop_longer'))} | {fmt(w.get('slower'))} | {fmt(w.get('merge_ms'), '.3f')} | "
                         f"{fmt(w.get('block_ms'))} | {fmt(w.get('compute_max_over_min'), '.3f')} |")
    tail = f"\ntorch context_parallel: {r['torch_cp_error']}\n" if r["torch_cp_error"] else ""
    return head + "\n".join(lines) + "\n" + tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument("--threads", type=int, default=1, help="torch threads a rank (default 1)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--recorded", type=int, default=5, help="recorded fwd+bwd calls per overlap mode")
    ap.add_argument("--seq-per-rank", type=int, default=None, help="tokens a rank (default: the device preset's)")
    args = ap.parse_args(argv)
    if args.smoke:  # 32 tokens a rank (CUDA, one rank: one sequence of 256), two rounds after one, one recorded call
        args.seq_per_rank, args.rounds, args.warmup, args.recorded = args.seq_per_rank or 32, 2, 1, 1
    world = world_size(args)
    if world is None:
        return 2
    preset = dict(PRESETS[args.device])
    if args.seq_per_rank:
        preset["seq_per_rank"] = args.seq_per_rank
    result = dict(device=device_label(args.device), world=world, torch=torch.__version__, preset=preset,
                  threads=args.threads, rounds=args.rounds, load_avg_before=os.getloadavg()[0])
    if args.device == "cuda" and world == 1:
        seqs = (256,) if args.smoke else CUDA_WS1_SEQS
        result.update(run_ranks(_fixed_cost_body, 1, preset, args.rounds, args.warmup, seqs, device="cuda",
                                timeout_s=600.0)[0])
    else:
        per_rank = run_ranks(_ring_body, world, args.device, preset, args.rounds, args.warmup, args.recorded,
                             args.threads, device=args.device, timeout_s=600.0)
        result["ring"] = summarize_ring(per_rank)
    tag = f"_s{preset['seq_per_rank']}" if preset["seq_per_rank"] != PRESETS[args.device]["seq_per_rank"] else ""
    write_results(result, os.path.join(out_dir(args), f"cp_overlap_{args.device}_ws{world}{tag}"), markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
