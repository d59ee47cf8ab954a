"""`overlapkit bench gemm`: measure this GPU's GEMM curve, the compute overlap hides behind.

Times every TP GEMM of Llama 3 8B/70B/405B (forward, dgrad, wgrad shapes) at TP 1-8 and
M = 128-16384 tokens, causal attention, and two memory-bound ops, in bf16 with CUDA events
and the L2 cache flushed before each run (as triton's do_bench does). Writes the raw grid and a
hardware JSON (a preset's links and peaks, this GPU's fitted curves) that `overlapkit plan
--hardware FILE` reads. Needs CUDA.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import time
from pathlib import Path

from .calibration import fit_curves
from .hardware import PRESETS, Hardware, preset
from .transformer import MODEL_PRESETS

GUESS = {"H200": "h200-sxm", "H100": "h100-sxm", "H800": "h800-sxm", "A800": "a800-sxm-80g", "A100": "a100-sxm-80g"}


def _timer(torch, reps: int):
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")

    def time_ms(fn) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(reps):
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    return time_ms


def measure(torch, quick: bool = False, log=print) -> dict:
    """The grid: GEMM rows, attention rows, memory-bound rows (the calibration format)."""
    import torch.nn.functional as F

    time_ms = _timer(torch, 10 if quick else 30)
    bf16 = torch.bfloat16
    models = ("llama3-8b", "llama3-70b") if quick else ("llama3-8b", "llama3-70b", "llama3-405b")
    tps = (1, 8) if quick else (1, 2, 4, 8)
    ms = (512, 8192) if quick else (128, 512, 2048, 8192, 16384)
    cache: dict = {}

    def gemm(m, k, n):
        if (m, k, n) not in cache:
            a, b = torch.randn(m, k, device="cuda", dtype=bf16), torch.randn(k, n, device="cuda", dtype=bf16)
            cache[(m, k, n)] = time_ms(lambda: a @ b)
        return cache[(m, k, n)]

    rows, t0 = [], time.time()
    for name, tp in itertools.product(models, tps):
        c = MODEL_PRESETS[name]
        shapes = {"qkv": (c.hidden, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim // tp),
                  "proj": (c.num_heads * c.head_dim // tp, c.hidden),
                  "fc1": (c.hidden, 2 * c.ffn_hidden // tp), "fc2": (c.ffn_hidden // tp, c.hidden)}
        for g, (k, n) in shapes.items():
            for m in ms:
                rows.append(dict(model=name, tp=tp, gemm=g, M=m, K=k, N=n, fwd_ms=gemm(m, k, n),
                                 dgrad_ms=gemm(m, n, k), wgrad_ms=gemm(k, m, n)))
        log(f"  {name} tp={tp}: {len(cache)} shapes, {time.time() - t0:.0f} s")
    attention = []
    for name, tp, seq in itertools.product(models, (1, 8), (2048, 8192)):
        c = MODEL_PRESETS[name]
        q, k, v = (torch.randn(1, c.num_heads // tp, seq, c.head_dim, device="cuda", dtype=bf16, requires_grad=True)
                   for _ in range(3))
        fwd = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        go = torch.randn(1, c.num_heads // tp, seq, c.head_dim, device="cuda", dtype=bf16)
        both = time_ms(lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), go))
        attention.append(dict(model=name, tp=tp, seq=seq, heads=c.num_heads // tp, head_dim=c.head_dim,
                              fwd_ms=fwd, fwd_bwd_ms=both))
    memory = []
    for h in (4096, 8192, 16384):
        x, w = torch.randn(8192, h, device="cuda", dtype=bf16), torch.ones(h, device="cuda", dtype=bf16)
        y = torch.randn_like(x)  # x + y is the three-access op the bandwidth is fitted on; x + x moves two
        memory.append(dict(tokens=8192, hidden=h, layernorm_ms=time_ms(lambda: F.layer_norm(x, (h,), w)),
                           add_ms=time_ms(lambda: x + x), x_plus_y_ms=time_ms(lambda: x + y)))
    return dict(device=torch.cuda.get_device_name(), torch=torch.__version__, gemm=rows,
                attention=attention, memory_bound=memory)


def hardware_from_grid(grid: dict, base: Hardware, sm_count: int) -> Hardware:
    """`base` (links, peaks) with curves fitted on every row of `grid`."""
    curves = fit_curves(grid, base.bf16_tflops, sm_count, held_out_m=(), held_out_attention_tp=(),
                        source=f"overlapkit bench gemm on {grid['device']} (torch {grid['torch']})")
    d = base.to_dict() | curves
    d.update(name=f"{base.name} (measured)", sm_count=sm_count)
    return Hardware.from_dict(d)


def run(args) -> int:
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        print("overlapkit bench gemm: needs a CUDA GPU, and none is visible here "
              "(torch.cuda.is_available() is False); run it on the GPU machine", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name()
    base_name = args.base or next((p for key, p in GUESS.items() if key in name), None)
    if base_name not in PRESETS:
        print(f"overlapkit bench gemm: error: base={base_name!r} for GPU {name!r}: pass --base one of "
              f"{', '.join(PRESETS)}", file=sys.stderr)
        return 2
    print(f"measuring GEMMs on {name} (base preset {base_name}) ...", file=sys.stderr)
    grid = measure(torch, args.quick, log=lambda s: print(s, file=sys.stderr))
    out = Path(args.out)
    grid_path = out.with_name(f"{out.stem}_grid.json")
    grid_path.write_text(json.dumps(grid, indent=0))
    hw = hardware_from_grid(grid, preset(base_name), torch.cuda.get_device_properties(0).multi_processor_count)
    out.write_text(json.dumps(hw.to_dict(), indent=1))
    g = hw.gemm
    print(f"wrote {out} (large GEMMs at {g.peak_fraction * hw.bf16_tflops:.0f} TFLOP/s, operand streaming "
          f"{g.mem_gbps:.0f} GB/s, launch {g.launch_us:.1f} us; {len(g.table)} shapes) and {grid_path}")
    return 0
