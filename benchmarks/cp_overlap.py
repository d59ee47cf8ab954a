"""Ring attention (context parallelism): the K/V exchange overlapped with the block in hand vs the
same ring with every transfer after its block (sequential), side by side in one run; forward and
forward+backward; exposed cp_kv from the timeline recorder.

Variants take turns call by call (each round in the next order of a balanced design) so that load
that comes and goes on a shared machine hits them alike; a call's time is the slowest rank's, the
table gives medians.
Exposed cp_kv comes from recorded calls made after the timed ones: the cp_kv time not covered by a
block's attention, as a share of the transfer time (a hop timed alone — ranks lined up, the ring's
exchange and nothing else — times the hops of the phase). The target: <= 10 % exposed where a
block's attention is longer than its transfer.

At world size 1 on CUDA there is no ring to overlap: the run measures the fixed cost of the ring
machinery (one block, the flash kernel, the log-sum-exp bookkeeping) against
`scaled_dot_product_attention` on the whole sequence, and PyTorch's experimental
`context_parallel` at a mesh of one, the same way. (PyTorch's context_parallel does not run on
CPU: it has no ring for `_scaled_dot_product_flash_attention_for_cpu`; the CPU run records its error.)

    python benchmarks/cp_overlap.py --world 2 --threads 1          # CPU, gloo, 2 ranks
    python benchmarks/cp_overlap.py --device cuda --world 1        # one GPU: fixed cost vs SDPA
    python benchmarks/cp_overlap.py --device cuda --world 8        # 8 GPUs, NCCL: the ring and torch's, side by side

Writes benchmarks/results/cp_overlap_<device>_ws<N>.json and .md.
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

from _common import add_common_args, backend, device_label, line_up, time_variants, world_size, write_results
from overlapkit.context_parallel import ContextParallelConfig, ring_attention, shard
from overlapkit.launch import spawn
from overlapkit.timeline import record
from overlapkit.timeline.report import measure

PRESETS = {
    # One block (512 queries against 256 keys, 4 heads of 64) takes a few ms on one CPU thread while
    # its 0.5 MiB of K/V crosses gloo's loopback in well under one: the regime the target speaks of.
    "cpu": dict(batch=1, heads=4, kv_heads=4, head_dim=64, seq_per_rank=512, dtype="float32"),
    "cuda": dict(batch=1, heads=32, kv_heads=8, head_dim=128, seq_per_rank=8192, dtype="bfloat16"),
}
CUDA_WS1_SEQS = (4096, 16384, 32768)
"""Whole-sequence lengths of the world-size-1 fixed-cost table."""
VARIANTS = ("pipelined", "none")


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
    """Every rank: time the overlapped and the sequential ring, then record both for exposed cp_kv."""
    torch.set_num_threads(threads)
    rank, size = dist.get_rank(), dist.get_world_size()
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    full = _inputs(p, p["seq_per_rank"] * size, device)
    q, k, v = (shard(t, 2, rank, size, "zigzag") for t in full)
    dout = torch.randn_like(q)
    group = dist.group.WORLD

    def call(overlap: str, backward: bool):
        cfg = ContextParallelConfig(overlap=overlap)

        def run():
            if not backward:
                with torch.no_grad():
                    ring_attention(q, k, v, group, config=cfg)
                return
            ql, kl, vl = (t.detach().requires_grad_() for t in (q, k, v))
            ring_attention(ql, kl, vl, group, config=cfg).backward(dout)
        return run

    calls = {f"{o} {'fwd+bwd' if b else 'fwd'}": call(o, b) for o in VARIANTS for b in (False, True)}
    torch_cp = _torch_cp_call(full, dout, device, size, rank)
    if callable(torch_cp):
        calls["torch context_parallel fwd+bwd"] = torch_cp
    times = _time_calls(calls, rounds, warmup, device)

    hop_ms = {"fwd": _hop_ms([k, v], device), "bwd": _hop_ms([k.float(), v.float()], device)}  # dK/dV travel in fp32
    per_mode = {}
    for overlap in VARIANTS:
        with record(device=device) as rec:
            for _ in range(recorded):
                line_up(device)
                rec.next_step()
                call(overlap, True)()
        per_mode[overlap] = _exposure(rec.spans)
    return dict(times=times, recorded=per_mode, hop_ms=hop_ms, torch_cp=None if callable(torch_cp) else torch_cp)


def _hop_ms(tensors, device, trials: int = 15) -> float:
    """A hop's transfer time alone: ranks line up, every rank sends these to the next and receives from the
    previous (the ring's exchange), nothing else runs; median over trials of the slowest rank."""
    from overlapkit import comm

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
        blocks = [s.duration_ms for s in mine if s.is_compute and not s.name.endswith(f"{phase}[0]")]
        hops = [s.duration_ms for s in mine if s.kind == "cp_kv"]
        out[phase] = dict(comm_ms=_median([t.comm_ms for t in times]), exposed_ms=_median([t.exposed_comm_ms for t in times]),
                          block_ms=_median(blocks), hop_ms=_median(hops), hops=len(hops) // max(len(steps), 1),
                          steps=[asdict(t) for t in times])
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

        def ring(backward):
            def run():
                ql, kl, vl = (t.detach().requires_grad_(backward) for t in (q, k, v))
                o = ring_attention(ql, kl, vl, dist.group.WORLD)
                if backward:
                    o.backward(dout)
            return run

        calls = {"sdpa fwd": sdpa(False), "sdpa fwd+bwd": sdpa(True), "ring fwd": ring(False), "ring fwd+bwd": ring(True)}
        torch_cp = _torch_cp_call([q, k, v], dout, device, 1, 0)
        if callable(torch_cp):
            calls["torch context_parallel fwd+bwd"] = torch_cp
        times = _time_calls(calls, rounds, warmup, device)
        rows[seq] = dict(times={n: _median(t) for n, t in times.items()},
                         torch_cp=None if callable(torch_cp) else torch_cp)
        del q, k, v, dout
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return dict(rows=rows)


def summarize_ring(per_rank: list[dict]) -> dict:
    times = {name: _median(t) for name, t in per_rank[0]["times"].items()}  # already the slowest rank's
    out = dict(times_ms=times, torch_cp_error=per_rank[0]["torch_cp"], phases={})
    for phase in ("fwd", "bwd"):
        seq = [r["recorded"]["none"][phase] for r in per_rank]
        pipe = [r["recorded"]["pipelined"][phase] for r in per_rank]
        hop = per_rank[0]["hop_ms"][phase]  # already the slowest rank's
        transfer = hop * seq[0]["hops"]
        exposed = _median([x["exposed_ms"] for x in pipe])
        block = _median([x["block_ms"] for x in seq])
        pct = 100.0 * exposed / transfer if transfer else None
        out["phases"][phase] = dict(
            transfer_ms=transfer, cp_kv_span_ms_sequential=_median([x["comm_ms"] for x in seq]),
            exposed_pipelined_ms=exposed, exposed_sequential_ms=_median([x["exposed_ms"] for x in seq]),
            exposed_pct=pct, block_ms=block, hop_ms=hop, hops=seq[0]["hops"],
            block_longer_than_hop=None if block is None or hop is None else block > hop,
            target_met=None if pct is None or block is None or hop is None or block <= hop else pct <= 10.0)
    return out


def markdown(result: dict) -> str:
    fmt = lambda v, spec=".2f": "—" if v is None else format(v, spec)  # noqa: E731
    p = result["preset"]
    head = (f"Ring attention, {result['device']}, world size {result['world']}, torch {result['torch']}, "
            f"{result['threads']} thread(s) a rank: batch {p['batch']}, {p['heads']} query / {p['kv_heads']} K/V heads of "
            f"{p['head_dim']}, {p['dtype']}, causal, zigzag. Load average when it started: "
            f"{result.get('load_avg_before', float('nan')):.1f} on {os.cpu_count()} cores.\n\n")
    if "rows" in result:  # world size 1: fixed cost
        lines = ["| sequence | sdpa fwd ms | ring fwd ms | ratio | sdpa fwd+bwd ms | ring fwd+bwd ms | ratio | torch CP fwd+bwd ms |",
                 "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for seq, row in result["rows"].items():
            t = row["times"]
            tcp = fmt(t.get("torch context_parallel fwd+bwd")) if row["torch_cp"] is None else "cannot run"
            lines.append(f"| {seq} | {fmt(t['sdpa fwd'])} | {fmt(t['ring fwd'])} | {fmt(t['ring fwd'] / t['sdpa fwd'], '.3f')} | "
                         f"{fmt(t['sdpa fwd+bwd'])} | {fmt(t['ring fwd+bwd'])} | "
                         f"{fmt(t['ring fwd+bwd'] / t['sdpa fwd+bwd'], '.3f')} | {tcp} |")
        errs = {row["torch_cp"] for row in result["rows"].values() if row["torch_cp"]}
        return head + "\n".join(lines) + "\n" + "".join(f"\ntorch context_parallel: {e}\n" for e in errs)
    r = result["ring"]
    t = r["times_ms"]
    lines = [f"sequence {p['seq_per_rank'] * result['world']} ({p['seq_per_rank']} a rank). Median ms of {result['rounds']} "
             "rounds, slowest rank.\n", "| variant | fwd ms | fwd+bwd ms |", "|---|---:|---:|"]
    for o in ("pipelined", "none"):
        lines.append(f"| ring overlap={o} | {fmt(t.get(o + ' fwd'))} | {fmt(t.get(o + ' fwd+bwd'))} |")
    tcp = t.get("torch context_parallel fwd+bwd")
    lines.append(f"| torch context_parallel | — | {fmt(tcp) if r['torch_cp_error'] is None else 'cannot run'} |")
    lines += ["", "| phase | hops | block attention ms | hop ms (alone) | transfer ms | exposed ms, overlapped "
              "| exposed % of transfer | target (<= 10 % where block > hop) |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for phase, x in r["phases"].items():
        verdict = {None: "n/a (block not longer than hop)", True: "met", False: "missed"}[x["target_met"]]
        lines.append(f"| {phase} | {x['hops']} | {fmt(x['block_ms'])} | {fmt(x['hop_ms'])} | {fmt(x['transfer_ms'])} | "
                     f"{fmt(x['exposed_pipelined_ms'])} | {fmt(x['exposed_pct'], '.1f')} | {verdict} |")
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
    world = world_size(args)
    if world is None:
        return 2
    preset = dict(PRESETS[args.device])
    if args.seq_per_rank:
        preset["seq_per_rank"] = args.seq_per_rank
    result = dict(device=device_label(args.device), world=world, torch=torch.__version__, preset=preset,
                  threads=args.threads, rounds=args.rounds, load_avg_before=os.getloadavg()[0])
    if args.device == "cuda" and world == 1:
        result.update(spawn(_fixed_cost_body, 1, preset, args.rounds, args.warmup, backend="nccl", timeout_s=600.0)[0])
    else:
        per_rank = spawn(_ring_body, world, args.device, preset, args.rounds, args.warmup, args.recorded, args.threads,
                         backend=backend(args.device), timeout_s=600.0)
        result["ring"] = summarize_ring(per_rank)
    write_results(result, os.path.join(args.out, f"cp_overlap_{args.device}_ws{world}"), markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
