"""How long a GEMM, an attention kernel and a memory-bound op take on one GPU.

These times are the compute that communication hides behind, so the whole overlap
prediction stands on them. A GEMM is a roofline with a short-K penalty,

    t = launch + max( 2mkn / (peak · f · k/(k + k_half)),  bytes(A, B, C) / W )

corrected, where a measured table exists, by the measured/modelled ratio of the nearest
measured shapes (inverse-distance weighted in log2(m, k, n), fading out two octaves away).
The correction is what carries cuBLAS's jumps (wave quantization, split-K choices) that no
four-number roofline has; the roofline is what answers far from any measurement. A chunked
GEMM is just a GEMM with m/chunks rows, so chunking losses fall out of the same curve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from . import _validate as v


@dataclass(frozen=True)
class GemmCurve:
    """GEMM time model of one GPU type (see the module docstring for the formula)."""

    peak_fraction: float
    """Share of the dense matrix peak that large GEMMs reach (cuBLAS never reaches 1)."""
    mem_gbps: float
    """Operand-streaming bandwidth, GB/s: GEMMs with few rows (m <= ~128) are bound by it."""
    launch_us: float
    """Fixed cost of one GEMM kernel, microseconds: why many small chunks lose."""
    k_half: float
    """Reduction length at which efficiency halves: short-K GEMMs pay prologue/epilogue."""
    table_dtype: str = "bf16"
    """Data type the measured table was taken in; other types use the roofline alone."""
    table: tuple[tuple[int, int, int, float], ...] = field(default=(), repr=False)
    """Measured (m, k, n, milliseconds) points; empty when only published figures are known."""
    neighbors: int = 4
    """How many nearest measured shapes correct a prediction."""
    reach_octaves: float = 2.0
    """How far (log2 distance) a measurement's correction still reaches, fading as a Gaussian."""
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """Predictions already made, and the table's residuals (planning asks for the same shapes often)."""

    def __post_init__(self) -> None:
        o = "GemmCurve"
        v.fraction(o, "peak_fraction", self.peak_fraction)
        v.positive(o, "mem_gbps", self.mem_gbps)
        v.positive(o, "launch_us", self.launch_us, allow_zero=True)
        v.positive(o, "k_half", self.k_half, allow_zero=True)
        v.positive_int(o, "neighbors", self.neighbors)
        v.positive(o, "reach_octaves", self.reach_octaves)
        for p in self.table:
            if len(p) != 4 or min(p) <= 0:
                raise v.ConfigError(f"GemmCurve.table: point {p!r} must be (m, k, n, ms) with all > 0")

    def roofline_ms(self, m: int, k: int, n: int, peak_tflops: float, dtype_bytes: int) -> float:
        """The analytic part alone."""
        flops = 2.0 * m * k * n
        eff = self.peak_fraction * k / (k + self.k_half)
        compute_ms = flops / (peak_tflops * 1e9 * eff)
        memory_ms = dtype_bytes * (m * k + k * n + m * n) / (self.mem_gbps * 1e6)
        return self.launch_us * 1e-3 + max(compute_ms, memory_ms)

    def time_ms(self, m: int, k: int, n: int, peak_tflops: float, dtype_bytes: int,
                dtype: str = "bf16") -> float:
        """Predicted time of an (m x k) @ (k x n) GEMM in milliseconds."""
        if min(m, k, n) < 1:
            raise v.ConfigError(f"GEMM shape m={m}, k={k}, n={n}: every size must be >= 1")
        base = self.roofline_ms(m, k, n, peak_tflops, dtype_bytes)
        if not self.table or dtype != self.table_dtype:
            return base
        key = (m, k, n, peak_tflops, dtype_bytes)
        if key not in self._memo:
            self._memo[key] = base * math.exp(self._correction(m, k, n, peak_tflops, dtype_bytes))
        return self._memo[key]

    def _correction(self, m: int, k: int, n: int, peak: float, dtype_bytes: int) -> float:
        """log(measured / roofline) near (m, k, n), from the table; 0 far from any measurement."""
        resid_key = ("residuals", peak, dtype_bytes)
        if resid_key not in self._memo:  # the table's own residuals, once per peak and dtype
            self._memo[resid_key] = [
                ((math.log2(pm), math.log2(pk), math.log2(pn)),
                 math.log(ms / self.roofline_ms(pm, pk, pn, peak, dtype_bytes)))
                for pm, pk, pn, ms in self.table]
        q = (math.log2(m), math.log2(k), math.log2(n))
        near = sorted((math.dist(q, p), r) for p, r in self._memo[resid_key])[: self.neighbors]
        if near[0][0] < 1e-9:
            return near[0][1]
        weights = [1.0 / d**2 for d, _ in near]
        corr = sum(w * r for w, (_, r) in zip(weights, near)) / sum(weights)
        return corr * math.exp(-((near[0][0] / self.reach_octaves) ** 2))


@dataclass(frozen=True)
class AttentionCurve:
    """Causal flash-attention time: launch + flops / (peak · f · u), u the last-wave fill."""

    peak_fraction: float
    """Share of the matrix peak that attention reaches when every SM has work."""
    launch_us: float
    """Fixed cost of the forward kernel, microseconds."""
    bwd_ratio: float
    """Backward time / forward time (backward does 2.5x the flops at lower efficiency)."""
    block_rows: int = 128
    """Query rows per thread block: blocks = batch · heads · ceil(seq / block_rows)."""

    def __post_init__(self) -> None:
        v.fraction("AttentionCurve", "peak_fraction", self.peak_fraction)
        v.positive("AttentionCurve", "launch_us", self.launch_us, allow_zero=True)
        v.positive("AttentionCurve", "bwd_ratio", self.bwd_ratio)
        v.positive_int("AttentionCurve", "block_rows", self.block_rows)

    def forward_ms(self, batch: int, heads: int, seq: int, head_dim: int,
                   peak_tflops: float, sm_count: int) -> float:
        flops = 2.0 * batch * heads * seq * seq * head_dim  # 4·s²·d·h halved by the causal mask
        waves = batch * heads * math.ceil(seq / self.block_rows) / sm_count
        fill = waves / math.ceil(waves)
        return self.launch_us * 1e-3 + flops / (peak_tflops * 1e9 * self.peak_fraction * fill)

    def backward_ms(self, *args) -> float:
        return self.bwd_ratio * self.forward_ms(*args)


@dataclass(frozen=True)
class MemoryCurve:
    """Memory-bound ops (norms, residual adds, activations): bytes / achieved bandwidth."""

    elementwise_gbps: float
    """Achieved GB/s of a binary elementwise op of two distinct tensors, counting two reads and one
    write (fitted on x + y: calibration.memory_curve says why not x + x); below the HBM peak."""
    norm_gbps: float
    """Achieved GB/s of a layer/RMS norm, counting one read and one write."""

    def __post_init__(self) -> None:
        v.positive("MemoryCurve", "elementwise_gbps", self.elementwise_gbps)
        v.positive("MemoryCurve", "norm_gbps", self.norm_gbps)

    def elementwise_ms(self, elements: int, dtype_bytes: int, accesses: int = 3) -> float:
        return accesses * elements * dtype_bytes / (self.elementwise_gbps * 1e6)

    def norm_ms(self, elements: int, dtype_bytes: int) -> float:
        return 2 * elements * dtype_bytes / (self.norm_gbps * 1e6)


# -- fitting (used to build presets from measurements; never at planning time) ----------------

def nelder_mead(f, x0: list[float], step: float = 0.3, iters: int = 4000, tol: float = 1e-10) -> list[float]:
    """Minimize f from x0 with the Nelder-Mead simplex (few parameters, no derivatives)."""
    pts = [list(x0)] + [[x + (step if i == j else 0.0) for j, x in enumerate(x0)] for i in range(len(x0))]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = sorted(range(len(pts)), key=vals.__getitem__)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if vals[-1] - vals[0] < tol:
            break
        centroid = [sum(p[j] for p in pts[:-1]) / (len(pts) - 1) for j in range(len(x0))]
        def towards(c: float) -> list[float]:
            return [cj + c * (wj - cj) for cj, wj in zip(centroid, pts[-1])]
        xr = towards(-1.0)
        fr = f(xr)
        if fr < vals[0]:
            xe = towards(-2.0)
            fe = f(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = towards(0.5)
            fc = f(xc)
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:  # shrink towards the best point
                pts = [pts[0]] + [[b + 0.5 * (x - b) for b, x in zip(pts[0], p)] for p in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    return pts[min(range(len(pts)), key=vals.__getitem__)]


def fit_gemm_curve(points, peak_tflops: float, dtype_bytes: int = 2, dtype: str = "bf16") -> GemmCurve:
    """Fit the roofline's four numbers to measured (m, k, n, ms) and keep the points as the table."""
    points = tuple((int(m), int(k), int(n), float(ms)) for m, k, n, ms in points)
    if len(points) < 4:
        raise v.ConfigError(f"fit_gemm_curve: {len(points)} points; need at least 4 measured shapes")

    def curve(x) -> GemmCurve:
        f, w, t0, kh = (math.exp(c) for c in x)
        return GemmCurve(peak_fraction=min(f, 1.0), mem_gbps=w, launch_us=t0, k_half=kh)

    def loss(x) -> float:
        c = curve(x)
        return sum(math.log(c.roofline_ms(m, k, n, peak_tflops, dtype_bytes) / ms) ** 2 for m, k, n, ms in points)

    best = nelder_mead(loss, [math.log(0.7), math.log(3000.0), math.log(5.0), math.log(100.0)])
    return replace(curve(best), table=points, table_dtype=dtype)


def fit_attention_curve(rows, peak_tflops: float, sm_count: int) -> AttentionCurve:
    """Fit to rows of (batch, heads, seq, head_dim, fwd_ms, fwd_bwd_ms)."""
    rows = list(rows)
    if len(rows) < 3:
        raise v.ConfigError(f"fit_attention_curve: {len(rows)} rows; need at least 3")

    def curve(x) -> AttentionCurve:
        f, t0, r = (math.exp(c) for c in x)
        return AttentionCurve(peak_fraction=min(f, 1.0), launch_us=t0, bwd_ratio=r)

    def loss(x) -> float:
        c, total = curve(x), 0.0
        for b, h, s, d, fwd, fwd_bwd in rows:
            pf = c.forward_ms(b, h, s, d, peak_tflops, sm_count)
            total += math.log(pf / fwd) ** 2 + math.log(pf * (1 + c.bwd_ratio) / fwd_bwd) ** 2
        return total

    return curve(nelder_mead(loss, [math.log(0.6), math.log(10.0), math.log(3.0)]))
