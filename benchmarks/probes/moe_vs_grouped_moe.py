"""overlapkit's MoE layer at one rank beside the two single-GPU MoEs it is measured against: transformers' own
grouped-GEMM experts (`grouped_mm_experts_forward`, the `experts_implementation="grouped_mm"` of Qwen3-MoE and
the other MoE families) and a torchtitan-style MoE (histc counts, argsort, gather, torch._grouped_mm, scatter_add
combine). The same router module and weights feed all three (so the routing and the auxiliary loss are the same),
the same non-gated GELU experts with biases, the same shapes; each is checked equal to overlapkit's layer first.

Per variant: forward+backward time per call (CUDA events on a GPU, the clock on CPU; per-round ratios to
transformers'), aten ops dispatched forward and backward (the host work, a kernel launch each on a GPU), the
host syncs one forward+backward asks for (ops that read a device value back: item, nonzero, an unsized
repeat_interleave), and on a GPU whether a no-grad forward captures into a CUDA graph.

    python benchmarks/probes/moe_vs_grouped_moe.py --device cuda      # one GPU: the shapes of ep_overlap.py
    python benchmarks/probes/moe_vs_grouped_moe.py                    # CPU: tiny shapes, the GPUs' path

Writes benchmarks/results/moe_vs_grouped_moe_<device>.json and .md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _lib
from _lib.common import add_common_args, device_label, init_one_rank, out_dir, write_results
from _lib.ops import layer_ops
from _lib.ratios import per_round, text
from _lib.unexported import GROUPED_DEVICES
from overlapkit.expert_parallel import MoE

SHAPES = {"cpu": dict(hidden=32, ffn=48, experts=8, top_k=2, tokens=64, dtype="float32"),
          "cuda": dict(hidden=2048, ffn=1408, experts=8, top_k=2, tokens=8192, dtype="bfloat16")}
OURS, HF, TITAN = "overlapkit MoE", "transformers grouped_mm", "torchtitan-style"
aten = torch.ops.aten
SYNCING = {aten._local_scalar_dense.default, aten.nonzero.default, aten.item.default}


class _Syncs(TorchDispatchMode):
    """Counts the ops that read a device value back to the host (a stall of the GPU's queue; refused in a
    CUDA graph's capture). A CPU tensor's tolist dispatches no op: on a GPU, CUDA's sync debug mode sees it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNCING or (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None):
            self.seen.append(str(func))
        return func(*args, **kwargs)


class _Experts(nn.Module):
    """The attributes transformers' grouped_mm experts function reads, holding the MoE layer's experts."""

    def __init__(self, moe: MoE) -> None:
        super().__init__()
        e = moe.experts
        self.num_experts = e.w1.shape[0]
        self.up_proj, self.up_proj_bias = nn.Parameter(e.w1.detach().clone()), nn.Parameter(e.b1.detach().clone())
        self.down_proj, self.down_proj_bias = nn.Parameter(e.w2.detach().clone()), nn.Parameter(e.b2.detach().clone())
        self.act_fn = F.gelu
        self.has_gate, self.has_bias, self.is_transposed = False, True, False
        self.has_post_expert_norm, self._is_expert_parallel = False, False


class _RoutedMoE(nn.Module):
    """The layer's router (a copy), then `experts_fn(self.experts, x, top_k_index, top_k_weights)`; the
    router's auxiliary loss kept as the layer keeps it."""

    def __init__(self, moe: MoE, experts_fn) -> None:
        super().__init__()
        self.router = type(moe.router)(moe.config.hidden, moe.config.num_experts, moe.config.top_k)
        self.router.load_state_dict(moe.router.state_dict())
        self.router.to(moe.experts.w1.device, moe.experts.w1.dtype)
        self.experts, self.experts_fn = _Experts(moe), experts_fn
        self.aux_loss = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        r = self.router(x2)
        self.aux_loss = r.aux_loss
        return self.experts_fn(self.experts, x2, r.experts, r.weights).view(x.shape)


def titan_experts(m: _Experts, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """torchtitan's MoE after its router (moe.py: histc counts, a stable argsort, gathered rows, grouped GEMMs
    over cumulative offsets, scores applied to the outputs, scatter_add back to the tokens), with the layer's
    non-gated GELU experts and their biases."""
    top_k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    counts = torch.histc(flat.float(), bins=m.num_experts, min=0, max=m.num_experts - 1)  # no host sync
    order = torch.argsort(flat, stable=True)
    scores = top_k_weights.reshape(-1)[order]
    tokens = order // top_k
    rows = torch.gather(x, 0, tokens.view(-1, 1).expand(-1, x.shape[1]))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    expert = flat[order]
    h = F.gelu(torch._grouped_mm(rows, m.up_proj.transpose(1, 2), offs=offs) + m.up_proj_bias[expert])
    y = torch._grouped_mm(h, m.down_proj.transpose(1, 2), offs=offs) + m.down_proj_bias[expert]
    y = (y.float() * scores.float().unsqueeze(1)).to(x.dtype)
    return torch.zeros_like(x).scatter_add_(0, tokens.view(-1, 1).expand(-1, x.shape[1]), y)


def _layers(p: dict, device, dtype) -> dict:
    from transformers.integrations.moe import grouped_mm_experts_forward

    torch.manual_seed(0)
    ours = MoE(p["hidden"], p["ffn"], p["experts"], p["top_k"], dist.group.WORLD, overlap="none", device=device,
               dtype=dtype)
    return {OURS: ours, HF: _RoutedMoE(ours, grouped_mm_experts_forward), TITAN: _RoutedMoE(ours, titan_experts)}


def _call(layer, x, dy) -> None:
    out = layer(x)
    (out.float().mul(dy).sum() + 0.01 * layer.aux_loss).backward()


def _check_equal(layers: dict, x, dy, device) -> dict:
    """Each variant's output and input gradient against overlapkit's layer (max abs diff / max abs)."""
    got = {}
    for name, layer in layers.items():
        xg = x.detach().requires_grad_()
        out = layer(xg)
        out.float().mul(dy).sum().backward()
        got[name] = (out.detach().float(), xg.grad.float())
        layer.zero_grad(set_to_none=True)
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))  # noqa: E731
    return {n: max(rel(got[n][0], got[OURS][0]), rel(got[n][1], got[OURS][1])) for n in layers if n != OURS}


def _syncs(layer, x, dy) -> list[str]:
    """The host syncs of one forward+backward: ops that read a device value back, and on a GPU every
    synchronization CUDA's own sync debug mode reports (a tolist, a blocking copy)."""
    mode = _Syncs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if x.is_cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with mode:
                _call(layer, x.detach().requires_grad_(), dy)
        finally:
            if x.is_cuda:
                torch.cuda.set_sync_debug_mode("default")
    layer.zero_grad(set_to_none=True)
    # "called a synchronizing CUDA operation"; not the notice that the debug mode is a prototype, which the
    # first variant measured would otherwise carry as a sync of its own.
    cuda = [f"CUDA: {str(w.message).splitlines()[0][:60]}" for w in caught
            if "synchronizing CUDA operation" in str(w.message)]
    return sorted(set(mode.seen + cuda))


def _graph_capture(layer, x) -> str:
    """Whether a no-grad forward captures into a CUDA graph (and replays): 'yes', or why not."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.no_grad():
            for _ in range(2):
                layer(x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g), torch.no_grad():
            layer(x)
        g.replay()
        torch.cuda.synchronize()
        return "yes"
    except Exception as e:  # noqa: BLE001 - the reason is the result
        torch.cuda.synchronize()
        return f"no: {type(e).__name__}: {str(e).splitlines()[0][:120]}"


def _ms(layer, x, dy, reps: int, device) -> float:
    xg = x.detach().requires_grad_()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            _call(layer, xg, dy)
        end.record()
        torch.cuda.synchronize(device)
        ms = start.elapsed_time(end) / reps
    else:
        t0 = time.perf_counter()
        for _ in range(reps):
            _call(layer, xg, dy)
        ms = (time.perf_counter() - t0) * 1e3 / reps
    layer.zero_grad(set_to_none=True)
    return ms


def run(device_type: str, p: dict, rounds: int, reps: int) -> dict:
    device = torch.device(device_type)
    dtype = getattr(torch, p["dtype"])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(p["tokens"], p["hidden"], generator=g).to(device, dtype)
    dy = torch.randn(p["tokens"], p["hidden"], generator=g).to(device, torch.float32)
    layers = _layers(p, device, dtype)
    diffs = _check_equal(layers, x, dy, device)
    ops = {n: layer_ops(layer, x, dy.to(dtype)) for n, layer in layers.items()}
    syncs = {n: _syncs(layer, x, dy) for n, layer in layers.items()}
    graph = {n: _graph_capture(layer, x) for n, layer in layers.items()} if device.type == "cuda" else {}
    times = {n: [] for n in layers}
    keys = list(times)
    for r in range(rounds + 1):  # round 0 warms up; the order rotates so that none always runs first
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            t = _ms(layers[k], x, dy, reps, device)
            if r:
                times[k].append(t)
    rows = [dict(variant=n, ops=ops[n], syncs=syncs[n], graph=graph.get(n, "—"), diff=diffs.get(n, 0.0),
                 ms=statistics.median(times[n]), vs_hf=per_round(times[n], times[HF])) for n in layers]
    return dict(rows=rows, times=times)


def markdown(r: dict) -> str:
    p = r["shape"]
    head = (f"MoE at one rank beside transformers' grouped_mm experts and a torchtitan-style MoE, {r['device']}, "
            f"{r['threads']} thread(s), torch {r['torch']}, transformers {r['transformers']}: hidden {p['hidden']}, "
            f"expert ffn {p['ffn']} (GELU, biases), {p['experts']} experts, top-{p['top_k']}, {p['tokens']} tokens, "
            f"{p['dtype']}; one router for all three. {r['note']} ms per forward+backward: medians of {r['rounds']} "
            f"rounds of {r['reps']} calls; ratio to transformers' per round (middle half). Ops: aten ops of a "
            "no-grad forward / a forward with grad / its backward (in brackets: not views or allocations). Syncs: "
            "ops of one forward+backward that read a device value back. diff: max |Δ| / max |ref| of output and "
            "input gradient against overlapkit's layer.\n\n")
    lines = ["| variant | ms fwd+bwd | vs transformers | ops fwd | ops fwd (grad) | ops bwd | host syncs | "
             "CUDA graph (fwd) | diff |", "|---|---:|---|---:|---:|---:|---|---|---:|"]
    for row in r["rows"]:
        o = {k: f"{v['ops']} ({v['kernels']})" for k, v in row["ops"].items()}
        lines.append(f"| {row['variant']} | {row['ms']:.3f} | {text(row['vs_hf'])} | {o['fwd']} | {o['fwd_grad']} | "
                     f"{o['bwd']} | {', '.join(row['syncs']) or 'none'} | {row['graph']} | {row['diff']:.1e} |")
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--reps", type=int, default=10, help="calls per round")
    a = ap.parse_args(argv)
    if a.smoke:
        a.rounds, a.reps = 2, 2
    if a.device == "cuda" and not torch.cuda.is_available():
        print("moe_vs_grouped_moe: --device cuda needs CUDA", file=sys.stderr)
        return 2
    torch.set_num_threads(a.threads)
    note = ""
    if a.device == "cpu":  # the GPUs' path, so that the ops and syncs counted are a GPU's
        GROUPED_DEVICES.add("cpu")
        note = "The GPU path (grouped GEMMs) switched on for CPU: ops and syncs are a GPU's; times are the CPU's."
    init_one_rank("gloo")
    import transformers

    p = SHAPES[a.device]
    r = dict(device=device_label(a.device), threads=a.threads, torch=torch.__version__,
             transformers=transformers.__version__, shape=p, note=note, rounds=a.rounds, reps=a.reps,
             **run(a.device, p, a.rounds, a.reps))
    write_results(r, os.path.join(out_dir(a), f"moe_vs_grouped_moe_{a.device}"), markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
