"""Turn a measured GEMM/attention grid into the curves that predict compute time.

The grid format is the one `overlapkit bench gemm` writes (and the H200 calibration runs
used): `gemm` rows of (M, K, N, fwd_ms, dgrad_ms, wgrad_ms) for the TP GEMMs of a layer,
`attention` rows, `memory_bound` rows (layer norm, x + x and x + y of 8192 x hidden bf16). The
compute times fitted here are what the planner weighs communication against when it decides how
much of it a GEMM can hide.

Some rows can be held out (by M): they are not fitted, so they can check the prediction.
"""

from __future__ import annotations

import json
from importlib import resources

from .gemm import fit_attention_curve, fit_gemm_curve

HELD_OUT_M = (2048,)
"""GEMM rows (token count M) the shipped H200 curve was not fitted on."""
HELD_OUT_ATTENTION_TP = (8,)
"""Attention rows (TP size) the shipped H200 curve was not fitted on."""
FITTED_HIDDEN = 8192
"""Hidden size of the memory-bound rows that were fitted; the others are held out."""


def gemm_shapes(row: dict) -> list[tuple[int, int, int, float]]:
    """The three GEMMs of one grid row as (m, k, n, ms): forward, dgrad, wgrad."""
    m, k, n = row["M"], row["K"], row["N"]
    return [(m, k, n, row["fwd_ms"]), (m, n, k, row["dgrad_ms"]), (k, m, n, row["wgrad_ms"])]


def split_gemm(grid: dict, held_out_m=HELD_OUT_M) -> tuple[list, list]:
    """(fitted, held-out) distinct GEMM shapes; a shape also measured in a fitted row is fitted."""
    fitted: dict = {}
    held: dict = {}
    for row in grid["gemm"]:
        target = held if row["M"] in held_out_m else fitted
        for m, k, n, ms in gemm_shapes(row):
            target.setdefault((m, k, n), ms)
    return ([(*s, ms) for s, ms in fitted.items()],
            [(*s, ms) for s, ms in held.items() if s not in fitted])


def attention_rows(grid: dict, tp_sizes) -> list[tuple]:
    """(batch, heads, seq, head_dim, fwd_ms, fwd_bwd_ms) rows of the given TP sizes."""
    return [(1, a["heads"], a["seq"], a["head_dim"], a["fwd_ms"], a["fwd_bwd_ms"])
            for a in grid["attention"] if a["tp"] in tp_sizes]


def add_probe() -> dict:
    """The H200's x + x and x + y timings (data/h200_add_probe.json, copied from
    benchmarks/results/hbm_add_probe_h200.json): what the shipped elementwise bandwidth is fitted on."""
    return json.loads(resources.files("overlapkit.costmodel").joinpath("data/h200_add_probe.json").read_text())


def with_add_probe(grid: dict, probe: dict) -> dict:
    """`grid` with each memory-bound row given the probe's x + y time of its hidden size
    (`x_plus_y_ms`); grids measured before `bench gemm` timed x + y have only x + x."""
    xy = {r["hidden"]: r["x_plus_y_ms"] for r in probe["rows"]}
    rows = [dict(r, x_plus_y_ms=xy[r["hidden"]]) if r["hidden"] in xy else r for r in grid["memory_bound"]]
    return {**grid, "memory_bound": rows}


def memory_curve(grid: dict, hidden: int = FITTED_HIDDEN) -> dict:
    """Elementwise and norm bandwidths from the memory-bound row of one hidden size.

    The elementwise bandwidth prices a binary op of two distinct tensors (a residual add, SwiGLU's
    product) at three DRAM accesses, so it is fitted on such an op: `x_plus_y_ms`, x + y counted as two
    reads and a write. Not on `add_ms`, x + x: both operands are one tensor, the second read hits in
    cache and DRAM moves two tensors (benchmarks/probes/hbm_add_probe.py). Counted as three it gave the H200
    5.69 TB/s, above its 4.8 TB/s HBM peak, and priced every memory-bound op ~25% too cheap; counted as
    two it gives 3.97 TB/s, but a two-stream op reaches less than a three-stream one (x + y: 4.28 TB/s),
    so x + x would misprice the ops the model has. The norm is counted as what layer_norm must move: x
    read and y written (the weight's h elements are negligible); a row is 8-32 KB, so a second pass over
    it stays in cache, and the 2.3 TB/s this gives the H200 is well below its peak.
    """
    row = next((r for r in grid["memory_bound"] if r["hidden"] == hidden), None)
    if row is None:
        raise ValueError(f"memory_bound has no row with hidden={hidden}")
    if "x_plus_y_ms" not in row:
        raise ValueError(f"memory_bound row hidden={hidden} has no x_plus_y_ms (x + y of two distinct tensors): "
                         "its add_ms times x + x, which moves two tensors, not the three a binary op is priced at; "
                         "rerun `overlapkit bench gemm` or merge a probe with calibration.with_add_probe")
    elements = row["tokens"] * row["hidden"]
    return {"elementwise_gbps": 3 * elements * 2 / row["x_plus_y_ms"] / 1e6,
            "norm_gbps": 2 * elements * 2 / row["layernorm_ms"] / 1e6}


def fit_curves(grid: dict, bf16_tflops: float, sm_count: int, *, held_out_m=HELD_OUT_M,
               held_out_attention_tp=HELD_OUT_ATTENTION_TP, source: str = "") -> dict:
    """The `gemm`, `attention`, `memory` entries of a hardware JSON, fitted on the grid."""
    fitted, _ = split_gemm(grid, held_out_m)
    gemm = fit_gemm_curve(fitted, bf16_tflops)
    tps = sorted({a["tp"] for a in grid["attention"]} - set(held_out_attention_tp))
    att = fit_attention_curve(attention_rows(grid, tps), bf16_tflops, sm_count)
    return {
        "gemm": {"peak_fraction": gemm.peak_fraction, "mem_gbps": gemm.mem_gbps,
                 "launch_us": gemm.launch_us, "k_half": gemm.k_half, "table_dtype": "bf16",
                 "table": [list(p) for p in gemm.table]},
        "attention": {"peak_fraction": att.peak_fraction, "launch_us": att.launch_us,
                      "bwd_ratio": att.bwd_ratio},
        "memory": memory_curve(grid),
        "source": source,
    }


def cross_entropy_bytes(probe: dict, hardware: str = "h200-sxm") -> tuple[float, float]:
    """(forward, backward) bytes per logit of the fp32 cross-entropy that fit lm_head_probe.py's
    measurements best: least squares, over every probe row, of what the measured head + loss
    takes beyond the model's own head GEMMs (logit-weighted: the large-vocabulary rows rule),
    in the memory curve's bytes. How layer.CE_BYTES was calibrated."""
    from .hardware import preset
    from .step import predict
    from .transformer import ModelConfig, ParallelConfig

    hw = preset(hardware)
    gbps = hw.for_training().memory.elementwise_gbps * 1e6
    fwd = bwd = squares = 0.0
    for r in probe["rows"]:
        model = ModelConfig(hidden=r["hidden"], ffn_hidden=r["hidden"], num_layers=1, num_heads=1,
                            seq_len=r["tokens"], vocab_size=r["vocab"], gated_mlp=False)
        p = predict(model, ParallelConfig(sp=False), hw)
        gemm_f, gemm_b = (sum(x["time_ms"] for x in b.rows if x["op"].startswith("lm_head"))
                          for b in (p.head_fwd, p.head_bwd))
        logits = r["tokens"] * r["vocab"]
        fwd += logits * (r["fwd_ms"] - gemm_f)
        bwd += logits * (r["fwd_bwd_ms"] - r["fwd_ms"] - gemm_b)
        squares += logits * logits
    return fwd / squares * gbps, bwd / squares * gbps
