"""Tensor-parallel overlap, side by side in one run: every TP GEMM of Llama 3 8B / 70B with its
all-gather or reduce-scatter done sequentially, in bulk, pipelined over p2p and over
symm_mem, and by PyTorch's fused async-TP ops; then a whole TP+SP layer, forward and
forward+backward, for each overlap mode of the layers.

Per GEMM (TP = world size unless --shape-tp says otherwise; tokens 8192 on CUDA):
  gemm        the GEMM alone, on the full (gathered) input
  comm        the collective alone
  sequential  collective then GEMM (AG) / GEMM then collective (RS)
  bulk        the collective async beside an independent GEMM of the same shape: what overlap
              gives where nothing depends on the transfer (Megatron's backward case)
  pipelined   overlapkit's all_gather_matmul / matmul_reduce_scatter, per transport and chunks
  torch fused torch.ops.symm_mem.fused_all_gather_matmul / fused_matmul_reduce_scatter (CUDA)
Overlap efficiency = (T_seq − T) / (T_seq − max(T_gemm, T_comm)): 1 hides all of the shorter
one, 0 is no better than sequential. At world size 1 nothing moves and the table shows what
chunking costs the GEMM instead (T_gemm / T), beside the one-GPU calibration probe's figure.

Times: CUDA events (host clock on CPU) per call, ranks lined up before each call, variants
taking turns call by call so that load that comes and goes hits them alike; the slowest
rank's time per round, median over rounds.

    python benchmarks/tp_overlap.py --device cpu                    # gloo, 2 ranks, small shapes
    python3 benchmarks/tp_overlap.py --device cuda                  # NCCL, one rank per GPU
    python3 benchmarks/tp_overlap.py --device cuda --shape-tp 8     # 1 GPU: TP=8 per-rank shapes

Writes benchmarks/results/tp_overlap_<device>_ws<N>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from _common import add_common_args, backend, device_label, line_up, world_size, write_results
from overlapkit.runtime import comm
from overlapkit.launch import spawn
from overlapkit.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from overlapkit.tensor_parallel.pipelined import all_gather_matmul, matmul_reduce_scatter

MODELS = {
    # Llama 3 (the released config.json files): hidden, MLP width, query heads, key/value heads; head dim 128.
    "llama3-8b": dict(hidden=4096, ffn=14336, heads=32, kv_heads=8),
    "llama3-70b": dict(hidden=8192, ffn=28672, heads=64, kv_heads=8),
}
BASELINES = ("gemm", "comm", "sequential")
"""Variants that define the efficiency scale rather than being measured on it."""
CPU_SHRINK = 32
"""On CPU every width is divided by this and tokens are 384 (divisible by 2·ws for ws ≤ 4)."""
CALIBRATION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "calibration",
                           "h200_1gpu_probe.json")


def tp_gemms(model: str, shrink: int) -> list[tuple[str, str, int, int]]:
    """(name, 'ag' or 'rs', K, N) of the full (unsplit) TP GEMMs of one layer."""
    m = MODELS[model]
    h, ffn = m["hidden"], m["ffn"]
    qkv = (m["heads"] + 2 * m["kv_heads"]) * h // m["heads"]
    full = [("qkv", "ag", h, qkv), ("proj", "rs", h, h), ("fc1", "ag", h, 2 * ffn), ("fc2", "rs", ffn, h)]
    return [(n, kind, k // shrink, nn // shrink) for n, kind, k, nn in full]


def _time_ms(fn, device: torch.device) -> float:
    line_up(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _rounds(variants: dict, device: torch.device, warmup: int, reps: int) -> dict:
    """Per variant: this rank's times (ms) per round, or the error that made it unavailable."""
    out, order = {}, list(variants)
    for name, fn in list(variants.items()):
        try:  # the first call finds out whether it runs here (same verdict on every rank)
            fn()
        except Exception as e:  # noqa: BLE001 — a variant this torch or machine lacks is reported, not fatal
            out[name] = {"error": str(e).splitlines()[0][:300]}
            del variants[name]
    names = list(variants)
    times = {n: [] for n in names}
    for i in range(warmup + reps):
        for n in names[i % len(names):] + names[:i % len(names)]:
            t = _time_ms(variants[n], device)
            if i >= warmup:
                times[n].append(round(t, 4))
    out.update({n: {"times": ts} for n, ts in times.items()})
    return {n: out[n] for n in order}


def _gemm_variants(kind: str, k: int, n: int, tp: int, tokens: int, chunk_list, group, device, dtype) -> dict:
    ws = comm.group_size(group)
    g = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device=device, dtype=dtype, generator=g)  # noqa: E731
    if kind == "ag":
        x_shard, w, x_full = rnd(tokens // ws, k), rnd(n // tp, k), rnd(tokens, k)
        buf = torch.empty(tokens, k, device=device, dtype=dtype)
        collective = lambda async_op: comm.all_gather(buf, x_shard, group, async_op=async_op)  # noqa: E731
        gemm = lambda: torch.mm(x_full, w.t())  # noqa: E731
        sequential = lambda: (collective(False), torch.mm(buf, w.t()))  # noqa: E731
        piped = lambda t, c: all_gather_matmul(x_shard, [w], group, chunks=c, transport=t)  # noqa: E731
        fused_name, fused_call = "fused_all_gather_matmul", lambda f: f(x_shard, [w.t()], 0, group.group_name)
    else:
        x, w = rnd(tokens, k // tp), rnd(n, k // tp)
        partial, out = rnd(tokens, n), torch.empty(tokens // ws, n, device=device, dtype=dtype)
        collective = lambda async_op: comm.reduce_scatter(out, partial, group, async_op=async_op)  # noqa: E731
        gemm = lambda: torch.mm(x, w.t())  # noqa: E731
        sequential = lambda: comm.reduce_scatter(out, gemm(), group, async_op=False)  # noqa: E731
        piped = lambda t, c: matmul_reduce_scatter(x, w, group, chunks=c, transport=t)  # noqa: E731
        fused_name, fused_call = "fused_matmul_reduce_scatter", lambda f: f(x, w.t(), "sum", 0, group.group_name)

    def bulk():
        h = collective(True)
        gemm()
        h.wait()

    v = {"gemm": gemm, "comm": lambda: collective(False), "sequential": sequential, "bulk": bulk}
    for transport in ("p2p", "symm_mem"):
        for c in chunk_list:
            v[f"pipelined {transport} c={c}"] = lambda t=transport, c=c: piped(t, c)
    fused = getattr(getattr(torch.ops, "symm_mem", None), fused_name, None)
    if device.type == "cuda" and fused is not None:
        v["torch fused"] = lambda: fused_call(fused)
    return v


class TPLayer(torch.nn.Module):
    """The TP+SP linears of one Llama layer: qkv → proj (+x), fc1 → SwiGLU → fc2 (+h).

    Attention itself is left out (it has no TP communication); the rank's query heads stand in
    for its output. Full widths are scaled so that each rank holds the TP=`tp` slice.
    """

    def __init__(self, model: str, shrink: int, tp: int, group, device, dtype, **overlap) -> None:
        super().__init__()
        ws = comm.group_size(group)
        (_, _, h, qkv), _, (_, _, _, ffn2), _ = tp_gemms(model, shrink)
        kw = dict(bias=False, sequence_parallel=True, device=device, dtype=dtype, **overlap)
        self.h_rank = h // tp
        self.qkv = ColumnParallelLinear(h, qkv * ws // tp, group, name="qkv", **kw)
        self.proj = RowParallelLinear(h * ws // tp, h, group, name="proj", **kw)
        self.fc1 = ColumnParallelLinear(h, ffn2 * ws // tp, group, name="fc1", **kw)
        self.fc2 = RowParallelLinear(ffn2 // 2 * ws // tp, h, group, name="fc2", **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.qkv(x)[..., :self.h_rank].contiguous()) + x
        gate, up = self.fc1(h).chunk(2, dim=-1)
        return self.fc2(torch.nn.functional.silu(gate) * up) + h


LAYER_MODES = {"none": dict(overlap="none"), "bulk": dict(overlap="bulk"),
               "pipelined p2p": dict(overlap="pipelined", transport="p2p"),
               "pipelined symm_mem": dict(overlap="pipelined", transport="symm_mem")}


def _layer_variants(model, shrink, tp, tokens, group, device, dtype) -> dict:
    ws = comm.group_size(group)
    x = torch.randn(tokens // ws, MODELS[model]["hidden"] // shrink, device=device, dtype=dtype)
    v = {}
    for mode, opts in LAYER_MODES.items():
        torch.manual_seed(0)
        layer = TPLayer(model, shrink, tp, group, device, dtype, **opts)
        xg = x.clone().requires_grad_(True)

        def fwd(layer=layer):
            with torch.no_grad():
                layer(x)

        def fwd_bwd(layer=layer, xg=xg):
            # A training step's backward: gradients set to None first (zero_grad's default), so
            # no round pays an accumulation that a step of one micro-batch does not.
            layer.zero_grad(set_to_none=True)
            xg.grad = None
            layer(xg).sum().backward()
        v[f"{mode} fwd"], v[f"{mode} fwd+bwd"] = fwd, fwd_bwd
    return v


def _rank_body(args: dict) -> dict:
    rank, ws = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank) if args["device"] == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shrink = 1 if device.type == "cuda" else CPU_SHRINK
    tp, tokens, group = args["shape_tp"] or ws, args["tokens"], dist.group.WORLD
    chunk_list = [ws, 2 * ws] if ws > 1 else [1, 2, 4, 8]
    res = {"gemms": {}, "layers": {}}
    for model in MODELS:
        if not args["layers_only"]:
            for name, kind, k, n in tp_gemms(model, shrink):
                v = _gemm_variants(kind, k, n, tp, tokens, chunk_list, group, device, dtype)
                res["gemms"][f"{model} {name}"] = {"kind": kind, "K": k, "N": n, "tp": tp,
                                                   "variants": _rounds(v, device, args["warmup"], args["reps"])}
        v = _layer_variants(model, shrink, tp, tokens, group, device, dtype)
        # Alone, the layers get every round: their ±2 % checks need the repeats the GEMM grid had.
        layer_reps = args["reps"] if args["layers_only"] else max(3, args["reps"] // 3)
        res["layers"][model] = _rounds(v, device, args["warmup"], layer_reps)
    return res


def _median_slowest(per_rank: list[dict]) -> float | None:
    if any("times" not in r for r in per_rank):
        return None
    return statistics.median(max(ts) for ts in zip(*(r["times"] for r in per_rank)))


def _calibration(path: str, result: dict) -> dict:
    """The probe's chunked-GEMM figures, where this run's shapes are the probe's (CUDA, 8192 tokens)."""
    if "CPU" in result["device"] or result["tokens"] != 8192:
        return {}
    try:
        with open(path) as f:
            return json.load(f).get("gemm", {})
    except (OSError, ValueError):
        return {}


def summarize(per_rank: list[dict], ws: int, calib: dict) -> dict:
    gemms = {}
    for key, g0 in per_rank[0]["gemms"].items():
        ms = {n: _median_slowest([r["gemms"][key]["variants"][n] for r in per_rank]) for n in g0["variants"]}
        t_seq, t_gemm, t_comm = ms["sequential"], ms["gemm"], ms["comm"]
        span = t_seq - max(t_gemm, t_comm)
        cal = calib.get(f"{key.split()[1]}({'AG+GEMM' if g0['kind'] == 'ag' else 'GEMM+RS'})", {})
        rows = {}
        for n, t in ms.items():
            row = rows[n] = {"ms": t, "error": g0["variants"][n].get("error")}
            if t is not None and ws > 1 and span > 0.01 * t_seq and n not in BASELINES:
                row["overlap_eff"] = (t_seq - t) / span
            if t is not None and ws == 1 and n.startswith("pipelined"):
                c = int(n.rsplit("=", 1)[1])
                row["chunk_eff"] = t_gemm / t
                if "70b" in key and g0["tp"] == 8 and f"x{c}_eff" in cal:
                    row["calibration_chunk_eff"] = cal[f"x{c}_eff"]
        gemms[key] = {k: g0[k] for k in ("kind", "K", "N", "tp")} | {"rows": rows}
    layers = {m: {n: {"ms": _median_slowest([r["layers"][m][n] for r in per_rank]),
                      "error": l0[n].get("error")} for n in l0}
              for m, l0 in per_rank[0]["layers"].items()}
    return {"gemms": gemms, "layers": layers}


def markdown(result: dict) -> str:
    fmt = lambda v, spec=".3f": "—" if v is None else format(v, spec)  # noqa: E731
    ws, s = result["world"], result["summary"]
    out = [f"TP overlap, {result['device']}, world size {ws}, per-rank shapes of TP={result['shape_tp']}, "
           f"{result['tokens']} tokens, {result['dtype']}, torch {result['torch']}, "
           f"CUDA_DEVICE_MAX_CONNECTIONS={result['cuda_device_max_connections']}. Median of {result['reps']} "
           "rounds, slowest rank. " + ("Overlap eff = (T_seq − T)/(T_seq − max(T_gemm, T_comm))." if ws > 1 else
                                       "World size 1: nothing moves; chunk eff = T_gemm / T (what chunking costs "
                                       "the GEMM), calibration = the one-GPU probe's x<c>_eff for 70B TP=8 shapes."),
           ""]
    if s["gemms"]:
        out += ["| GEMM | M×K×N (per rank) | variant | ms | overlap eff | chunk eff | calibration |",
                "|---|---|---|---:|---:|---:|---:|"]
    for key, g in s["gemms"].items():
        k = g["K"] // (g["tp"] if g["kind"] == "rs" else 1)
        n = g["N"] // (g["tp"] if g["kind"] == "ag" else 1)
        for name, row in g["rows"].items():
            ms = fmt(row["ms"]) if row["error"] is None else "n/a: " + row["error"][:90]
            out.append(f"| {key} ({g['kind']}) | {result['tokens']}×{k}×{n} | {name} | {ms} | "
                       f"{fmt(row.get('overlap_eff'), '.2f')} | {fmt(row.get('chunk_eff'), '.2f')} | "
                       f"{fmt(row.get('calibration_chunk_eff'), '.2f')} |")
    out += ["", "Whole TP+SP layer (qkv, proj, fc1, fc2 linears; attention left out):", "",
            "| model | mode | ms |", "|---|---|---:|"]
    for model, rows in s["layers"].items():
        for name, row in rows.items():
            ms = fmt(row["ms"]) if row["error"] is None else "n/a: " + row["error"][:90]
            out.append(f"| {model} | {name} | {ms} |")
    return "\n".join(out) + "\n"


def device_slug(device: str) -> str:
    if device == "cpu":
        return "cpu"
    return torch.cuda.get_device_name(0).split()[-1].lower().replace("-", "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument("--shape-tp", type=int, default=None, help="TP degree of the per-rank shapes (default: world size)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per step (default: 8192 on CUDA, 384 on CPU)")
    ap.add_argument("--reps", type=int, default=None, help="timed rounds per GEMM variant (default: 30 CUDA, 15 CPU)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--calibration", default=CALIBRATION, help="one-GPU probe JSON to compare chunk costs with")
    ap.add_argument("--render", metavar="JSON", help="no run: re-summarize a result JSON (e.g. with --calibration)")
    ap.add_argument("--layers-only", action="store_true",
                    help="only the whole-layer rows (every round), not the GEMM grid: the no-regression check")
    a = ap.parse_args(argv)
    if a.render:
        with open(a.render) as f:
            result = json.load(f)
        result["summary"] = summarize(result["raw"], result["world"], _calibration(a.calibration, result))
        write_results(result, os.path.join(a.out, os.path.splitext(os.path.basename(a.render))[0]), markdown)
        return 0
    world = world_size(a)
    if world is None:
        return 2
    args = dict(device=a.device, shape_tp=a.shape_tp, warmup=a.warmup, layers_only=a.layers_only,
                tokens=a.tokens or (8192 if a.device == "cuda" else 384),
                reps=a.reps or (30 if a.device == "cuda" else 15))
    per_rank = spawn(_rank_body, world, args, backend=backend(a.device), timeout_s=900.0)
    result = dict(device=device_label(a.device),
                  world=world, shape_tp=a.shape_tp or world, tokens=args["tokens"], reps=args["reps"],
                  dtype="bf16" if a.device == "cuda" else "fp32", torch=torch.__version__,
                  cuda_device_max_connections=os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
                  raw=per_rank)
    result["summary"] = summarize(per_rank, world, _calibration(a.calibration, result))
    tp_tag = f"_tp{a.shape_tp}" if a.shape_tp not in (None, world) else ""
    tag = "_layers" if a.layers_only else ""
    write_results(result, os.path.join(a.out, f"tp_overlap_{device_slug(a.device)}_ws{world}{tp_tag}{tag}"),
                  markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
