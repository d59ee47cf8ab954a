"""The GPU and its links: how fast GEMMs run and how fast bytes move while they run.

Overlap hides a collective's time behind GEMMs; whether it can depends on these numbers:
matrix peak and the GEMM-efficiency curve (compute), link latency and bandwidth per tier
(communication), and how much a GEMM slows down while communication shares the GPU.

Presets carry published figures (source beside each) and, for H200, curves fitted on our own
measurements (`data/h200-sxm.json`, written by benchmarks/model_vs_measured.py). Other GPUs
take H200's fitted curve at their own published matmul efficiency (MAMF), HBM bandwidth and,
for a power-limited H100, clock; each preset's `source` says which, until `overlapkit bench gemm`
measures the GPU itself.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, replace
from functools import lru_cache
from importlib import resources
from pathlib import Path

from . import _validate as v
from .gemm import AttentionCurve, GemmCurve, MemoryCurve

HOST_US_PER_OP = 20.5
"""Calibrated on our H200 runs (benchmarks/model_vs_measured.py, 'host' section): the DP benchmark's GPT
step without communication, whose kernels are too short to hide their dispatch. 20.5 us reproduces its
latest run (23.7 ms) with the host's lead carried through the launch queue (host_queue); under the
per-layer pricing before it, 15 us reproduced the earlier run (20.5 ms)."""

DTYPE_BYTES = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}
"""Bytes per element of each data type the model knows."""


@dataclass(frozen=True)
class Link:
    """One tier of interconnect, as seen by one GPU (alpha-beta model)."""

    name: str
    """What it is, e.g. 'NVLink 4 via NVSwitch'."""
    alpha_us: float
    """Latency of one algorithm step (one hop of a ring), microseconds."""
    bandwidth_gbps: float
    """Peak bandwidth per GPU per direction, GB/s (for a network: the GPU's NIC share)."""
    efficiency: float = 0.8
    """Share of the peak a large collective reaches (nccl-tests bus bandwidth / peak)."""

    def __post_init__(self) -> None:
        v.positive("Link", "alpha_us", self.alpha_us, allow_zero=True)
        v.positive("Link", "bandwidth_gbps", self.bandwidth_gbps)
        v.fraction("Link", "efficiency", self.efficiency)

    @property
    def bus_gbps(self) -> float:
        """Bandwidth a large collective actually gets, GB/s."""
        return self.bandwidth_gbps * self.efficiency


@dataclass(frozen=True)
class Hardware:
    """One kind of GPU node: compute curves, memory, links and contention."""

    name: str
    """Preset name or a user's label."""
    bf16_tflops: float
    """Dense bf16/fp16 matrix peak, TFLOP/s (no sparsity)."""
    fp8_tflops: float
    """Dense fp8 matrix peak, TFLOP/s; 0 when the GPU has no fp8 tensor cores."""
    fp32_tflops: float
    """Dense tf32 matrix peak, TFLOP/s (what fp32 GEMMs use)."""
    hbm_gbps: float
    """HBM bandwidth, GB/s."""
    hbm_gib: float
    """HBM capacity, GiB."""
    sm_count: int
    """Streaming multiprocessors: attention's last-wave fill depends on it."""
    gpus_per_node: int
    """GPUs sharing the intra-node link (one NVLink/NVSwitch domain)."""
    intra: Link
    """Link between GPUs of one node."""
    inter: Link
    """Link between nodes (per GPU: the node's network bandwidth / gpus_per_node)."""
    gemm: GemmCurve
    """GEMM time model."""
    attention: AttentionCurve
    """Flash-attention time model."""
    memory: MemoryCurve
    """Memory-bound op model."""
    sm_comm_slowdown: float = 1.10
    """GEMM time factor while an SM-driven collective (NCCL kernels) runs beside it: the
    kernels take SMs, and cuBLAS may then need an extra wave (PyTorch async-TP post)."""
    copy_engine_slowdown: float = 1.02
    """GEMM time factor beside copy-engine transfers (symmetric memory): they take no SMs,
    only HBM bandwidth; H200 hid 98.6% of a copy-engine transfer behind a GEMM."""
    flash2_slowdown: float = 1.0
    """Attention time of FlashAttention-2-class kernels relative to the fitted curve (cuDNN/FA3-class):
    on Hopper FA2 reaches ~35% of the matrix peak (FlashAttention-3 paper, arXiv 2407.08608) where
    our H200 fit reaches 65%; on Ampere FA2 is what the curve already is."""
    sustained_clock: float = 1.0
    """Share of the curves' matmul and attention rate the GPU holds through a training run.
    The curves come from short kernel benchmarks (our H200 grid, published MAMF sweeps) that run
    at boost clock; minutes of every SM doing tensor work drive the part to its power limit and the
    clock settles lower. `predict` (a whole step) applies it; per-kernel prices (`gemm_ms`, the
    planner, the Flux/async-TP checks) do not. See SUSTAINED_CLOCK for the values and their basis."""
    host_us_per_op: float = HOST_US_PER_OP
    """Host time to dispatch one framework op (PyTorch eager, autograd included), microseconds:
    the GPU waits when a layer's kernels are shorter than their dispatch."""
    optimizer_host_ms: float = 0.0
    """Host time of the optimizer's step beyond its kernels' dispatch (calibrated from a trace; 0: none): the
    GPU's optimizer kernels wait for it, after the backward's."""
    source: str = ""
    """Where the numbers come from."""

    def __post_init__(self) -> None:
        o = f"Hardware({self.name})"
        for f in ("bf16_tflops", "fp32_tflops", "hbm_gbps", "hbm_gib"):
            v.positive(o, f, getattr(self, f))
        v.positive(o, "host_us_per_op", self.host_us_per_op, allow_zero=True)
        v.positive(o, "optimizer_host_ms", self.optimizer_host_ms, allow_zero=True)
        if not 0.3 <= self.sustained_clock <= 1.0:
            raise v.ConfigError(f"{o}.sustained_clock={self.sustained_clock!r}: must be in [0.3, 1]")
        if not 1.0 <= self.flash2_slowdown <= 5.0:
            raise v.ConfigError(f"{o}.flash2_slowdown={self.flash2_slowdown!r}: must be in [1, 5]")
        for f in ("elementwise_gbps", "norm_gbps"):  # above the peak: bytes miscounted (x + x as three accesses)
            if getattr(self.memory, f) > self.hbm_gbps:
                raise v.ConfigError(f"{o}.memory.{f}={getattr(self.memory, f):.0f}: must be at most hbm_gbps="
                                    f"{self.hbm_gbps:g}; a file from an older `overlapkit bench gemm` counted x + x "
                                    "as three accesses: measure again")
        v.positive(o, "fp8_tflops", self.fp8_tflops, allow_zero=True)
        v.positive_int(o, "sm_count", self.sm_count)
        v.positive_int(o, "gpus_per_node", self.gpus_per_node)
        for f in ("sm_comm_slowdown", "copy_engine_slowdown"):
            if not 1.0 <= getattr(self, f) <= 3.0:
                raise v.ConfigError(f"{o}.{f}={getattr(self, f)}: must be in [1, 3]")

    def peak_tflops(self, dtype: str) -> float:
        v.one_of("Hardware", "dtype", dtype, tuple(DTYPE_BYTES))
        peak = {"fp8": self.fp8_tflops, "fp32": self.fp32_tflops}.get(dtype, self.bf16_tflops)
        if peak <= 0:
            raise v.ConfigError(f"Hardware({self.name}).fp8_tflops=0: this GPU has no {dtype} matrix units")
        return peak

    def gemm_ms(self, m: int, k: int, n: int, dtype: str = "bf16") -> float:
        """Predicted time of an (m x k) @ (k x n) GEMM, milliseconds."""
        return self.gemm.time_ms(m, k, n, self.peak_tflops(dtype), DTYPE_BYTES[dtype], dtype)

    def attention_ms(self, batch: int, heads: int, seq: int, head_dim: int,
                     dtype: str = "bf16") -> tuple[float, float]:
        """Causal attention (forward, backward) milliseconds for heads on this GPU."""
        args = (batch, heads, seq, head_dim, self.peak_tflops(dtype), self.sm_count)
        return self.attention.forward_ms(*args), self.attention.backward_ms(*args)

    def for_training(self) -> "Hardware":
        """This GPU with its matmul and attention rates at the clock it sustains through a training run."""
        return self if self.sustained_clock == 1.0 else _at_sustained_clock(self)

    def comm_slowdown(self, transport: str) -> float:
        """GEMM slowdown beside a transfer of this transport ('nccl', 'p2p' or 'symm_mem')."""
        return self.copy_engine_slowdown if transport == "symm_mem" else self.sm_comm_slowdown

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["gemm"].pop("_memo", None)
        d["gemm"]["table"] = [list(p) for p in self.gemm.table]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Hardware":
        if not isinstance(d, dict):
            raise v.ConfigError(f"hardware: must be a JSON object (as Hardware.to_dict writes), not {type(d).__name__}")
        d = dict(d)
        for key in ("intra", "inter", "gemm", "attention", "memory"):
            if key not in d:
                raise v.ConfigError(f"hardware: missing key {key!r}")
            if not isinstance(d[key], dict):
                raise v.ConfigError(f"hardware.{key}={d[key]!r}: must be a JSON object")
        d["intra"], d["inter"] = (v.from_dict(Link, d[k], f"hardware.{k}") for k in ("intra", "inter"))
        g = dict(d["gemm"])
        table = g.get("table", ())
        if not isinstance(table, list | tuple) or not all(isinstance(p, list | tuple) for p in table):
            raise v.ConfigError("hardware.gemm.table: must be a list of [m, k, n, ms] points")
        g["table"] = tuple(tuple(p) for p in table)
        d["gemm"] = v.from_dict(GemmCurve, g, "hardware.gemm")
        d["attention"] = v.from_dict(AttentionCurve, d["attention"], "hardware.attention")
        d["memory"] = v.from_dict(MemoryCurve, d["memory"], "hardware.memory")
        return v.from_dict(cls, d, "hardware")


@lru_cache(maxsize=64)
def _at_sustained_clock(hw: Hardware) -> Hardware:
    """`hw` with its curves' matmul and attention shares scaled by its sustained clock (cached: the
    planner prices the same shapes again on every prediction)."""
    c = hw.sustained_clock
    return replace(hw, sustained_clock=1.0, gemm=replace(hw.gemm, peak_fraction=hw.gemm.peak_fraction * c),
                   attention=replace(hw.attention, peak_fraction=hw.attention.peak_fraction * c))


# -- presets -----------------------------------------------------------------------------------

def _h200_measured() -> dict:
    """H200 curves fitted on the calibration runs (see benchmarks/model_vs_measured.py)."""
    text = resources.files("overlapkit.costmodel").joinpath("data/h200-sxm.json").read_text()
    return json.loads(text)


# Links. NVLink 4 (H100/H200 SXM): 18 links, 900 GB/s bidirectional = 450 GB/s per direction
# (NVIDIA H100 datasheet); nccl-tests all-reduce bus bandwidth on DGX H100 without NVLS is
# ~360 GB/s, hence 0.8. NVLink 3 (A100 SXM): 600 GB/s bidirectional (A100 datasheet).
# H800 / A800 are export variants with NVLink cut to 400 GB/s bidirectional (NVIDIA H800 and
# A800 product briefs). Networks: DGX H100/H200 have 8x ConnectX-7 400 Gb/s = 50 GB/s per GPU;
# DGX A100 has 8x ConnectX-6 200 Gb/s HDR = 25 GB/s per GPU (DGX user guides). Alphas are
# per ring step: ~2 us over NVSwitch, ~5 us over InfiniBand (nccl-tests small-message times).
_NVLINK4 = Link("NVLink 4 via NVSwitch", alpha_us=2.0, bandwidth_gbps=450.0, efficiency=0.8)
_NVLINK4_EXPORT = Link("NVLink 4, export variant (400 GB/s bidirectional)", 2.0, 200.0, 0.8)
_NVLINK3 = Link("NVLink 3 via NVSwitch", alpha_us=2.5, bandwidth_gbps=300.0, efficiency=0.8)
_NVLINK3_EXPORT = Link("NVLink 3, export variant (400 GB/s bidirectional)", 2.5, 200.0, 0.8)
_NDR400 = Link("InfiniBand NDR 400 Gb/s per GPU", alpha_us=5.0, bandwidth_gbps=50.0, efficiency=0.9)
_HDR200 = Link("InfiniBand HDR 200 Gb/s per GPU", alpha_us=5.0, bandwidth_gbps=25.0, efficiency=0.9)


# Published matmul measurements: the "Maximum Achievable Matmul FLOPS" (MAMF) table of
# stas00/ml-engineering (compute/accelerator/README.md; mamf-finder.py, bf16, best of a shape
# sweep): A100 SXM 267.9 of 312 TFLOP/s (85.9%), H100 SXM 792.1 of 989 (80.1%), H100/H200 SXM
# 794.5 (80.3%). A GPU's curve is H200's measured one with its large-GEMM share of peak scaled by
# its MAMF efficiency relative to H200's and its own HBM bandwidth for the operand-bound part;
# H200's measured table (its cuBLAS choices and HBM3e timing) is not carried over to any other GPU.
MAMF_EFFICIENCY = {"h200-sxm": 794.5 / 989.4, "h100-sxm": 792.1 / 989.4, "a100-sxm-80g": 267.9 / 312.0}
"""Published best-shape matmul rate / dense peak, per GPU (sources above)."""
FA2_HOPPER_FRACTION = 0.35
"""FlashAttention-2's share of the H100 matrix peak (FlashAttention-3 paper: "only 35% utilization on H100")."""
POWER_LIMIT_CLOCK = 0.70
"""Matmul (and attention) rate of an H100 held at 500 W, as a share of the 700 W part's: calibrated
once, by least squares, on the two vanilla-TP bf16 runs of torchtitan's async-TP benchmark on this
hardware (Llama 3.1 70B on 256 GPUs, 597.3 tokens/s per GPU; 8B on 64, 4378: its
benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md), which are not among the published steps the
model is checked against (benchmarks/model_vs_published.py prints both: +6.6%, -6.4%; rechecked after
the memory bandwidth was refit on x + y: the least squares is 0.702, so 0.70 stands). About a
1.3 GHz sustained tensor clock against 1.83. The 700 W part's sustained clock is derived from it
(power_limited_clock)."""

POWER_LAW_EXPONENT = 3.0
"""Dynamic power against clock under DVFS: P ~ C·V²·f with the voltage rising in proportion to the clock,
so P ~ f³ and a part held at a power limit P runs its tensor cores at f ~ P^(1/3) (the usual first-order
law; no fitted number)."""
H100_TDP_W = 700.0
"""H100 SXM5 maximum TDP (NVIDIA H100 datasheet; the 700 W part of DGX H100 and of the Megatron/Llama 3 runs)."""
POWER_LIMIT_W = 500.0
"""The Grand Teton H100's default power limit (torchtitan benchmarks), where POWER_LIMIT_CLOCK was measured."""


def power_limited_clock(watts: float, anchor_watts: float = POWER_LIMIT_W, anchor_clock: float = POWER_LIMIT_CLOCK) -> float:
    """The share of its curves' rate a GH100 part sustains at `watts`: the 500 W measurement moved along
    the cube law P ~ f³ (capped at 1, the short-run curve)."""
    return min(1.0, anchor_clock * (watts / anchor_watts) ** (1.0 / POWER_LAW_EXPONENT))


SUSTAINED_CLOCK = {"h100-sxm": power_limited_clock(H100_TDP_W), "a100-sxm-80g": 1.0}
"""Hardware.sustained_clock of the 700 W H100 SXM (also H800, the same part) and the 400 W A100 SXM (also
A800). Derived, not fitted on any published step: the H100's is the 500 W measurement (POWER_LIMIT_CLOCK,
from torchtitan's async-TP runs) moved to 700 W along the cube law, 0.70 x (700/500)^(1/3) = 0.783. The
A100 keeps 1.0: its curve is its published MAMF, a sweep that already runs at the part's power limit, and
no measurement of an A100 sustaining less under a training load was found (Megatron's own A100 steps,
Narayanan 2021 and Korthikanti 2022, are predicted within 7% at 1.0; benchmarks/model_vs_published.py).
These replace the least-squares clocks over the 30 published steps (H100 0.824, A100 0.889), which were
fitted on the cases they were judged by. H200 keeps 1.0: its curves and every H200 row we check are our
own runs."""


def _derived(name: str, hbm_gbps: float, mamf: float, clock: float = 1.0, sustained: float = 1.0,
             **published) -> Hardware:
    """A GPU from published figures and its MAMF efficiency on H200's measured curve (see above)."""
    h200 = preset("h200-sxm")
    ratio = hbm_gbps / h200.hbm_gbps
    scale = mamf / MAMF_EFFICIENCY["h200-sxm"] * clock
    gemm = replace(h200.gemm, peak_fraction=min(1.0, h200.gemm.peak_fraction * scale),
                   table=(), mem_gbps=h200.gemm.mem_gbps * ratio)
    attention = replace(h200.attention, peak_fraction=min(1.0, h200.attention.peak_fraction * scale))
    memory = MemoryCurve(h200.memory.elementwise_gbps * ratio, h200.memory.norm_gbps * ratio)
    hopper = published.get("fp8_tflops", 0) > 0
    slow = max(1.0, h200.attention.peak_fraction / FA2_HOPPER_FRACTION) if hopper else 1.0
    return Hardware(name=name, hbm_gbps=hbm_gbps, gemm=gemm, attention=attention, memory=memory,
                    flash2_slowdown=slow, sustained_clock=sustained, **published)


@lru_cache(maxsize=None)
def preset(name: str) -> Hardware:
    """A hardware preset by name (see PRESETS)."""
    if name == "h200-sxm":
        # H200 SXM: 989.4 bf16 / 1978.9 fp8 dense TFLOP/s, 4.8 TB/s HBM3e, 141 GB, 132 SMs
        # (NVIDIA H200 datasheet). Curves: measured, data/h200-sxm.json.
        m = _h200_measured()
        return Hardware(
            name=name, bf16_tflops=989.4, fp8_tflops=1978.9, fp32_tflops=494.7, hbm_gbps=4800.0,
            hbm_gib=141 * 1e9 / 2**30, sm_count=132, gpus_per_node=8, intra=_NVLINK4, inter=_NDR400,
            gemm=v.from_dict(GemmCurve, {**m["gemm"], "table": tuple(map(tuple, m["gemm"]["table"]))}, "h200.gemm"),
            attention=v.from_dict(AttentionCurve, m["attention"], "h200.attention"),
            memory=v.from_dict(MemoryCurve, m["memory"], "h200.memory"), source=m["source"],
            flash2_slowdown=max(1.0, m["attention"]["peak_fraction"] / FA2_HOPPER_FRACTION))
    # H100 SXM5: 989.4 bf16 / 1978.9 fp8 dense TFLOP/s, 3.35 TB/s HBM3, 80 GB, 132 SMs
    # (NVIDIA H100 Tensor Core GPU datasheet); DGX H100: 8 GPUs, 8x 400 Gb/s.
    hopper = dict(bf16_tflops=989.4, fp8_tflops=1978.9, fp32_tflops=494.7, hbm_gib=80 * 1e9 / 2**30,
                  sm_count=132, gpus_per_node=8, inter=_NDR400)
    # A100 SXM4 80GB: 312 bf16 / 156 tf32 dense TFLOP/s, 2.039 TB/s HBM2e, 108 SMs, no fp8
    # (NVIDIA A100 datasheet); DGX A100: 8 GPUs, NVLink 3, 8x 200 Gb/s HDR.
    ampere = dict(bf16_tflops=312.0, fp8_tflops=0.0, fp32_tflops=156.0, hbm_gib=80 * 1e9 / 2**30,
                  sm_count=108, gpus_per_node=8, inter=_HDR200)
    h100 = ("H100 SXM 700 W: published figures; GEMM curve = H200's fitted roofline (same GH100 die and clocks) "
            "at H100's MAMF efficiency (792.1/989, ml-engineering) and HBM3 bandwidth, without H200's measured table")
    a100 = ("A100 SXM 80GB: published figures; GEMM curve = H200's fitted roofline at A100's MAMF efficiency "
            "(267.9/312, ml-engineering) and HBM2e bandwidth, without H200's measured table")
    if name == "h100-sxm":
        return _derived(name, 3350.0, MAMF_EFFICIENCY["h100-sxm"], sustained=SUSTAINED_CLOCK["h100-sxm"],
                        intra=_NVLINK4, source=h100, **hopper)
    if name == "h100-sxm-500w":
        # Grand Teton H100 as in torchtitan's benchmarks (benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md):
        # 96 GB HBM2e at 2.4 TB/s, the default 500 W power limit, NVLink 4, 400 Gb/s RDMA per GPU.
        src = (f"H100 96GB HBM2e at 500 W (torchtitan benchmarks): H100's curve (MAMF 792.1/989) at 2.4 TB/s and a "
               f"{POWER_LIMIT_CLOCK} matmul-rate share at 500 W (calibrated, see POWER_LIMIT_CLOCK)")
        return _derived(name, 2400.0, MAMF_EFFICIENCY["h100-sxm"], POWER_LIMIT_CLOCK, intra=_NVLINK4,
                        source=src, **{**hopper, "hbm_gib": 96 * 1e9 / 2**30})
    if name == "h800-sxm":
        return _derived(name, 3350.0, MAMF_EFFICIENCY["h100-sxm"], sustained=SUSTAINED_CLOCK["h100-sxm"],
                        intra=_NVLINK4_EXPORT,
                        source=h100.replace("H100 SXM 700 W", "H800 SXM (H100 with NVLink cut)"), **hopper)
    if name == "a100-sxm-80g":
        return _derived(name, 2039.0, MAMF_EFFICIENCY["a100-sxm-80g"], sustained=SUSTAINED_CLOCK["a100-sxm-80g"],
                        intra=_NVLINK3, source=a100, **ampere)
    if name == "a800-sxm-80g":
        return _derived(name, 2039.0, MAMF_EFFICIENCY["a100-sxm-80g"], sustained=SUSTAINED_CLOCK["a100-sxm-80g"],
                        intra=_NVLINK3_EXPORT,
                        source=a100.replace("A100 SXM 80GB", "A800 SXM 80GB (A100 with NVLink cut)"), **ampere)
    raise v.ConfigError(f"hardware={name!r}: unknown preset; known: {', '.join(PRESETS)} "
                        f"(or a path to a JSON file)")


PRESETS = ("h100-sxm", "h100-sxm-500w", "h200-sxm", "a100-sxm-80g", "h800-sxm", "a800-sxm-80g")
"""Names `preset` and `load_hardware` accept."""


def load_hardware(spec: "str | Path | Hardware") -> Hardware:
    """A preset name, a JSON file (as written by `Hardware.to_dict` / `overlapkit bench gemm`), or a Hardware."""
    if isinstance(spec, Hardware):
        return spec
    if str(spec) in PRESETS:
        return preset(str(spec))
    path = Path(spec)
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise v.ConfigError(f"hardware={str(spec)!r}: no such file")
        try:
            return Hardware.from_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise v.ConfigError(f"hardware={str(spec)!r}: not valid JSON ({e.msg} at line {e.lineno})") from None
    return preset(str(spec))
