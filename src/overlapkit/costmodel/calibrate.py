"""The cost model calibrated on a user's own trace: what one traced layout of a job says about its cluster.

A profiler trace of one layout tells, for that job on that machine, how long its GEMMs took (by name, hence
by shape), how long the rest of its compute took, how long each kind of collective took at the sizes it
moved, how much of each kind stayed exposed, and how long the ranks sat idle waiting for the host. `fit`
turns those into a calibrated `Hardware` (the measured GEMM shapes pinned in its table, the rest of its
compute rates scaled until the traced layout's compute is the measured compute), per-collective time
factors, the measured exposed fraction per kind and a host time per dispatched op; `predict_calibrated`
then prices another layout of the same job with them. The trace is read by the tools layer (the analyzer's
reader), which hands over a plain `Measured`: the cost model does not import the analyzer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

from . import _validate as v
from .collectives import Collectives, Group
from .hardware import Hardware
from .model import ModelConfig
from .parallel import MODES, Overlap, ParallelConfig
from .host_fit import bisect, bisected_dispatch, measured_dispatch, ops_per_step
from .traced_comm import (KIND_COLLECTIVE, PerCallCollectives, call_map, calls_at, engine_of, model_calls, model_kind,
                          per_call_ms, traced_comm)
from .step import StepReport, predict
from .transformer import layer_gemms

PIPELINE_KINDS = ("pp_send", "pp_recv")
"""Kinds whose exposed time `terms` counts with the bubble: a stage waiting for its neighbour's compute or the wire."""
TERMS = ("compute", "exposed", "pipeline", "host")
"""The terms a step splits into (`terms`)."""
GEMM_PHASES = ("fwd", "dgrad", "wgrad")
"""Phases of a layer GEMM a trace may name (forward, input gradient, weight gradient)."""
DEVICES = ("cpu", "gpu")
"""Where a traced job computed (Measured.device)."""
COMM_FOLLOWS = ("bytes", "calls")
"""What a traced job's collective times follow (Measured.comm_follows)."""
COMM_FOLLOWS_ON = {"cpu": "calls", "gpu": "bytes"}
"""What a trace's collective times follow, by where it computed: a CPU's are gloo's (rendezvous-bound at a layer's
sizes), a GPU's NCCL's (bytes over the links)."""


@dataclass(frozen=True)
class Measured:
    """One traced layout, per step, on its slowest rank (what the tools layer reads from a trace)."""

    step_ms: float
    """Wall time of one step."""
    compute_ms: float
    """Time some computation ran (the union of compute spans)."""
    idle_ms: float
    """Time neither computation nor communication ran: the rank waited for its host (or a peer)."""
    gemm: dict = field(default_factory=dict)
    """(GEMM name, phase) -> (ms per step, calls per step), for GEMMs the trace names (qkv, proj, fc1, fc2,
    lm_head; fwd, dgrad, wgrad)."""
    comm: dict = field(default_factory=dict)
    """Communication kind -> (comm ms per step, exposed ms per step, calls per step, bytes per call or 0)."""
    steps: int = 1
    """Steps averaged."""
    ranks: int = 1
    """Ranks read."""
    device: str = "cpu"
    """Where the job computed: 'cpu' (the host that dispatches also computes, so its time per op adds to the
    step) or 'gpu' (the host dispatches ahead through the launch queue; the GPU waits only where the dispatch
    has fallen behind its work over the step so far: costmodel.host_queue)."""
    host_busy_ms: float | None = None
    """On a GPU, the host's own time per step: the step less the time its threads sat in a synchronization
    with the GPU. What dispatch took whether or not the GPU waited for it (None: the trace cannot tell)."""
    optimizer_ms: float | None = None
    """Compute a step launched inside torch's `Optimizer.step#...` range (None: none), set apart from the rates."""
    optimizer_host_ms: float | None = None
    """On a GPU, the host's own time a step inside that range: not the layers' dispatch (None: not read)."""
    comm_follows: str = "bytes"
    """What the collectives' time follows: 'bytes' (NCCL: the α-β model's bytes and group, scaled) or 'calls'
    (gloo on a CPU: a fixed time a call, the ranks' rendezvous and thread handoffs; the idle around them too)."""

    def __post_init__(self) -> None:
        v.positive("Measured", "step_ms", self.step_ms)
        if not (isinstance(self.compute_ms, (int, float)) and self.compute_ms > 0):
            raise v.ConfigError(f"Measured.compute_ms={self.compute_ms!r}: the traced steps show no computation on the "
                                f"slowest rank ({self.step_ms:.3g} ms per step, {self.ranks} rank(s), {self.steps} step(s)); "
                                f"calibration needs the compute ranges or kernels of a training step")
        v.positive("Measured", "idle_ms", self.idle_ms, allow_zero=True)
        v.one_of("Measured", "device", self.device, DEVICES)
        v.one_of("Measured", "comm_follows", self.comm_follows, COMM_FOLLOWS)
        if self.host_busy_ms is not None:
            v.positive("Measured", "host_busy_ms", self.host_busy_ms, allow_zero=True)

    def to_record(self) -> dict:
        """Plain JSON: every field, the GEMMs as [name, phase, ms, calls] lists (`from_record` reads it back)."""
        return {**vars(self), "gemm": [[*k, *x] for k, x in self.gemm.items()]}

    @classmethod
    def from_record(cls, record: dict) -> "Measured":
        """A `to_record` back; records written before `comm_follows` existed get their device's (COMM_FOLLOWS_ON)."""
        return cls(**{"comm_follows": COMM_FOLLOWS_ON[record.get("device", "cpu")], **record,
                      "gemm": {(g[0], g[1]): tuple(g[2:]) for g in record["gemm"]}})


class CalibratedCollectives(Collectives):
    """The model's collectives, each collective's time scaled by what the trace measured against it."""

    def __init__(self, hardware: Hardware, factors: dict) -> None:
        super().__init__(hardware)
        self.factors = dict(factors)

    def time_ms(self, kind: str, nbytes: float, group: Group, algo: str = "auto") -> float:
        return super().time_ms(kind, nbytes, group, algo) * self.factors.get(kind, 1.0)


@dataclass
class Calibration:
    """What `fit` learned from one traced layout."""

    hardware: Hardware
    """The base hardware with the job's compute rates and measured GEMM shapes."""
    comm_factors: dict
    """Collective -> measured time / the model's time at the traced sizes."""
    exposed_fraction: dict
    """Communication kind -> exposed / total, as measured (waits inside compute ranges included)."""
    host_us_per_op: float
    """Idle time per dispatched framework op (HOST_OPS_PER_LAYER per layer forward, twice backward)."""
    compute_scale: float
    """The job's memory-bound rate relative to the base hardware's (1: as the preset; 0.01: 100x slower)."""
    traced: ParallelConfig
    """The traced layout."""
    gemm_points: tuple = ()
    """(m, k, n, ms) of every GEMM the trace named, pinned in the hardware's table."""
    notes: list = field(default_factory=list)
    """Measured kinds the model has no counterpart for, and other things assumed."""
    matmul_scale: float = 1.0
    """The job's matrix rate relative to the base hardware's (from the named GEMMs; compute_scale without)."""
    device: str = "cpu"
    """Measured.device: 'cpu' adds host_us_per_op per op to the step; 'gpu' puts it in the hardware's
    dispatch time per op, which the GPU waits for only where the dispatch falls behind its work (host_queue)."""
    engine_exposed: dict = field(default_factory=dict)
    """Engine kind the model has no counterpart for -> exposed ms per step at the traced layout."""
    host_step_ms: float = 0.0
    """On a GPU: the traced idle that the layers' dispatch does not explain (the step's edges: the optimizer's
    launches, a loss read back), added once per step at every layout."""
    optimizer_factor: float = 1.0
    """Traced optimizer step's time / the model's at the fitted rates; each layout's optimizer and other passes
    over the parameters (StepReport.param_passes_ms) are the model's times it."""
    comm_per_call: dict = field(default_factory=dict)
    """Collective -> ms per call (Measured.comm_follows 'calls'), in place of comm_factors; empty: bytes."""
    host_ms_per_call: float = 0.0
    """On a CPU whose collectives follow calls: the traced idle per collective call (the thread handoffs on both
    sides of each blocking call), in place of host_us_per_op; 0: per op."""
    call_map: dict = field(default_factory=dict)
    """Traced kind -> (calls per step, the model's kind or '', its calls at the traced layout): traced_comm.calls_at."""

    @property
    def collectives(self) -> Collectives:
        if self.comm_per_call:
            return PerCallCollectives(self.hardware, self.comm_per_call)
        return CalibratedCollectives(self.hardware, self.comm_factors)

    def traced_summary(self) -> str:
        p = self.traced
        return (f"tp={p.tp} pp={p.pp} dp={p.dp} cp={p.cp} ep={p.ep} micro_batch={p.micro_batch} "
                f"global_batch={p.global_batch}")

    def to_dict(self) -> dict:
        return {"compute_scale": self.compute_scale, "matmul_scale": self.matmul_scale, "device": self.device,
                "engine_exposed": dict(self.engine_exposed),
                "comm_factors": dict(self.comm_factors),
                "exposed_fraction": dict(self.exposed_fraction), "host_us_per_op": self.host_us_per_op,
                "host_step_ms": self.host_step_ms, "optimizer_factor": self.optimizer_factor,
                "comm_per_call": dict(self.comm_per_call), "host_ms_per_call": self.host_ms_per_call,
                "gemm_points": [list(p) for p in self.gemm_points], "notes": list(self.notes)}

    def summary(self) -> str:
        comm = ", ".join(f"{k} {f:.3g} ms a call" for k, f in self.comm_per_call.items()) or \
            ", ".join(f"{k} x{f:.3g}" for k, f in self.comm_factors.items()) or "none traced"
        exp = ", ".join(f"{k} {100 * f:.0f}%" for k, f in self.exposed_fraction.items()) or "none traced"
        return (f"fitted: matrix rate {self.matmul_scale:.3g}x and memory rate {self.compute_scale:.3g}x the "
                f"preset's ({len(self.gemm_points)} GEMM shapes pinned); collective time vs the model: {comm}; exposed: {exp}; "
                + (f"host {self.host_ms_per_call:.3g} ms per collective call" if self.host_ms_per_call else
                   f"host {self.host_us_per_op:.1f} us per op")
                + (f" and {self.host_step_ms:.3g} ms per step" if self.host_step_ms else "")
                + "".join(f"\n  note: {n}" for n in self.notes))


def traced_layout(asked: ParallelConfig, spec: str) -> ParallelConfig:
    """The traced layout: `asked` with the fields of `spec` ('tp=2,dp=2,micro_batch=1,overlap_tp=bulk')."""
    if not spec.strip():
        return asked
    names = {f.name: f for f in fields(ParallelConfig)}
    changes, overlap = {}, {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep:
            raise v.ConfigError(f"--traced {spec!r}: {item!r} is not field=value")
        if key.startswith("overlap_") and key[8:] in vars(Overlap()):
            overlap[key[8:]] = value
        elif key == "overlap":
            overlap.update(dict.fromkeys(vars(Overlap()), value))
        elif key in names and key != "overlap":
            default = getattr(ParallelConfig(), key)
            try:
                changes[key] = (value.lower() in ("1", "true", "yes")) if isinstance(default, bool) else type(default)(value)
            except ValueError:
                raise v.ConfigError(f"--traced {spec!r}: {key}={value!r} is not a {type(default).__name__}") from None
        else:
            raise v.ConfigError(f"--traced {spec!r}: unknown field {key!r}; known: {', '.join(n for n in names if n != 'overlap')}, overlap, overlap_<engine>")
    for mode in overlap.values():
        v.one_of("--traced", "overlap", mode, MODES)
    if overlap:
        changes["overlap"] = replace(asked.overlap, **overlap)
    if ("dp" in changes or "micro_batch" in changes) and "global_batch" not in changes:  # keep m per replica
        changes["global_batch"] = changes.get("micro_batch", asked.micro_batch) * changes.get("dp", asked.dp) * asked.micro_batches
    return replace(asked, **changes)


def rescaled(hw: Hardware, matmul: float, memory: float, table: tuple) -> Hardware:
    """`hw`, its matrix rates `matmul` and memory rates (HBM, memory-bound ops, GEMM operands) `memory` times as fast."""
    return replace(hw, name=f"{hw.name} (calibrated)", bf16_tflops=hw.bf16_tflops * matmul,
                   fp8_tflops=hw.fp8_tflops * matmul, fp32_tflops=hw.fp32_tflops * matmul, hbm_gbps=hw.hbm_gbps * memory,
                   gemm=replace(hw.gemm, mem_gbps=hw.gemm.mem_gbps * memory, table=table),
                   memory=replace(hw.memory, elementwise_gbps=hw.memory.elementwise_gbps * memory,
                                  norm_gbps=hw.memory.norm_gbps * memory),
                   sustained_clock=1.0, host_us_per_op=0.0, source=f"calibrated on a trace from {hw.name}")


def gemm_points(measured: Measured, model: ModelConfig, traced: ParallelConfig) -> tuple:
    """(m, k, n, ms per call) of each GEMM the trace names, at the traced layout's shapes on one rank."""
    shapes = {g.name: g for g in layer_gemms(model, traced)}
    tokens = traced.micro_batch * model.seq_len // traced.cp
    points = []
    for (name, phase), (ms, calls) in sorted(measured.gemm.items()):
        if calls <= 0 or ms <= 0 or phase not in GEMM_PHASES:
            continue
        if name == "lm_head":
            m, k, n = tokens, model.hidden, model.vocab_size // traced.tp
        elif name in shapes:
            g = shapes[name]
            m, k, n = g.m, g.k, g.n
        else:
            continue
        shape = {"fwd": (m, k, n), "dgrad": (m, n, k), "wgrad": (k, m, n)}[phase]
        points.append((shape, ms, calls))
    merged: dict = {}  # GEMMs of one shape (a square layer's fwd and dgrad): their calls' mean time
    for shape, ms, calls in points:
        t, c = merged.get(shape, (0.0, 0.0))
        merged[shape] = (t + ms, c + calls)
    return tuple((*shape, t / c) for shape, (t, c) in sorted(merged.items()))


def _matmul_rate(points: tuple, base: Hardware) -> float | None:
    """The job's matrix rate against `base`: the named GEMMs' geometric-mean speed against its curve."""
    if not points:
        return None
    plain = base.for_training()
    return math.exp(sum(math.log(plain.gemm_ms(m, k, n) / ms) for m, k, n, ms in points) / len(points))


def _fitted_ms(report: StepReport, optimizer_measured) -> float:
    """Predicted compute less, where the optimizer's step is measured, it and the other passes over the parameters."""
    return report.compute_ms - (report.optimizer_ms + report.param_passes_ms if optimizer_measured else 0.0)


def _memory_rate(target_ms: float, model: ModelConfig, traced: ParallelConfig, base: Hardware, matmul,
                 points: tuple, without_optimizer: bool = False) -> float:
    """The memory rate (bisected) at which the traced layout's `_fitted_ms` is `target_ms`."""
    def compute_ms(log_rate: float) -> float:
        rate = math.exp(log_rate)
        return _fitted_ms(predict(model, traced, rescaled(base, matmul or rate, rate, points)), without_optimizer)

    # predicted compute falls as the rate rises
    lo, hi = bisect(lambda log_rate: compute_ms(log_rate) > target_ms, math.log(1e-12), math.log(1e6))
    return math.exp((lo + hi) / 2)


def fit(measured: Measured, model: ModelConfig, traced: ParallelConfig, base: Hardware) -> Calibration:
    """Calibrate `base` on one traced layout (see the module docstring).

    The named GEMMs set the job's matrix rate and stay pinned. What the measured compute holds beyond what that
    rate predicts is either the rest of the compute running slower than the preset's ratio says, or the ranks
    sitting inside compute ranges while a collective they wait for is in flight (a CPU trace's forward and
    backward ranges hold the synchronous TP collectives' waits). The second is at most the time the trace shows
    collectives hidden under compute: counted as exposed time of those collectives (in proportion to each one's
    hidden time); the memory rate is bisected to meet the rest. Without named GEMMs one rate scales all compute."""
    notes: list[str] = []
    points = gemm_points(measured, model, traced)
    matmul = _matmul_rate(points, base)
    base_report = predict(model, traced, rescaled(base, matmul or 1.0, matmul or 1.0, points))
    by_kind, unmatched, engine_exposed = traced_comm(measured, base_report.comm_by_kind, notes)
    hidden = {k: max(0.0, c - e) for k, (c, e) in by_kind.items()}
    opt = measured.optimizer_ms if 0 < (measured.optimizer_ms or 0) < measured.compute_ms else None
    # the other passes over the parameters run as the optimizer's do (multi-tensor, memory-bound): at its rate
    passes = opt * base_report.param_passes_ms / base_report.optimizer_ms if opt and base_report.optimizer_ms else 0.0
    waiting, fitted = 0.0, measured.compute_ms - (opt or 0.0) - passes
    if matmul is not None:  # the compute beyond the GEMMs' rate's, the optimizer's step set apart on both sides
        waiting = min(max(0.0, fitted - _fitted_ms(base_report, opt)), sum(hidden.values()))
    target = fitted - waiting
    scale = matmul if matmul is not None and abs(_fitted_ms(base_report, opt) - target) <= 1e-9 * target else \
        _memory_rate(target, model, traced, base, matmul, points, opt is not None)
    hw = rescaled(base, matmul or scale, scale, points)
    r = predict(model, traced, hw)
    factor = opt / r.optimizer_ms if opt and r.optimizer_ms > 0 else 1.0
    if opt:
        notes.append(f"the optimizer's step measured {opt:.3g} ms per step against the model's {r.optimizer_ms:.3g} "
                     f"ms at the fitted rates: it and the other passes over the parameters ({passes:.3g} ms here) priced "
                     f"x{factor:.3g} at every layout, apart from the fitted rates")
    if abs(_fitted_ms(r, opt) - target) > 0.01 * target:
        notes.append(f"the traced compute ({target:.3g} ms) cannot be met by the memory rate beside the named "
                     f"GEMMs: the fit stops at {scale:.3g}x")
    if waiting > 0:
        total = sum(hidden.values())
        for k in by_kind:
            by_kind[k][1] += waiting * hidden[k] / total
        notes.append(f"{waiting:.3g} ms per step inside compute ranges, while collectives were in flight, is beyond "
                     f"what the named GEMMs' rate predicts: counted as waiting for those collectives")
    factors: dict[str, list[tuple[float, float]]] = {}
    for kind, (comm_ms, _) in by_kind.items():
        factors.setdefault(KIND_COLLECTIVE[kind], []).append((comm_ms, r.comm_by_kind[kind]))
    comm_factors = {c: sum(m for m, _ in xs) / sum(p for _, p in xs) for c, xs in factors.items()}
    exposed = {k: min(1.0, e / c) for k, (c, e) in by_kind.items()}
    idle, host_step, per_call, calls_of, host_call = measured.idle_ms + unmatched, 0.0, {}, {}, 0.0
    if measured.comm_follows == "calls":
        calls = model_calls(predict, model, traced, hw)
        per_call, calls_of = per_call_ms(by_kind, calls), call_map(measured, calls)
        notes.append("collectives priced per call, not per byte (gloo: each call a rendezvous of the ranks)")
    n_calls = sum(n for n, _, _ in calls_of.values())
    if measured.device == "cpu" and n_calls > 0:
        host_us, host_call = 0.0, idle / n_calls
    elif measured.device == "cpu":
        host_us = 1e3 * idle / ops_per_step(model, traced)
    else:
        if measured.host_busy_ms is not None:
            hw = replace(hw, optimizer_host_ms=measured.optimizer_host_ms or 0.0)
            host_us, host_step = measured_dispatch(measured.host_busy_ms, idle, model, traced, hw, notes)
        else:
            host_us = bisected_dispatch(idle, model, traced, hw, base.host_us_per_op, notes)
        hw = replace(hw, host_us_per_op=host_us)
    return Calibration(hw, comm_factors, exposed, host_us, scale, traced, points, notes, matmul_scale=matmul or scale,
                       device=measured.device, engine_exposed=engine_exposed, host_step_ms=host_step,
                       optimizer_factor=factor, comm_per_call=per_call, host_ms_per_call=host_call, call_map=calls_of)


def predict_calibrated(cal: Calibration, model: ModelConfig, par: ParallelConfig) -> StepReport:
    """One step of `par` priced with what `cal` measured: the calibrated hardware and collectives, the
    measured exposed fraction of every traced kind (the model's own overlap for the others), the exposed time
    of traced engine kinds the model lacks (where that engine runs, per layer and micro-batch) and the host
    time per op."""
    r = predict(model, par, cal.hardware, cal.collectives)
    f = cal.optimizer_factor  # the optimizer's measured rate, for it and the other passes over the parameters
    r.compute_ms += (f - 1) * (r.optimizer_ms + r.param_passes_ms)
    r.optimizer_ms, r.step_end_ms, r.param_passes_ms = f * r.optimizer_ms, f * r.step_end_ms, f * r.param_passes_ms
    exposed = {k: (c * cal.exposed_fraction[k] if k in cal.exposed_fraction else r.exposed_by_kind.get(k, 0.0))
               for k, c in r.comm_by_kind.items()}
    per_op = ops_per_step(model, par) / ops_per_step(model, cal.traced)
    for kind, ms in cal.engine_exposed.items():
        if getattr(par, engine_of(kind)) > 1:
            exposed[kind] = exposed.get(kind, 0.0) + ms * (1.0 if engine_of(kind) == "dp" else per_op)
    r.exposed_by_kind, r.exposed_ms = exposed, sum(exposed.values())
    if cal.host_ms_per_call:  # the handoffs around each collective call (gloo on a CPU)
        r.host_ms = cal.host_ms_per_call * calls_at(cal.call_map, model_calls(predict, model, par, cal.hardware), par,
                                                    per_op)
    elif cal.device == "cpu":  # on a GPU the model's own host wait stands, at the fitted dispatch time
        r.host_ms = cal.host_us_per_op * 1e-3 * ops_per_step(model, par)
    else:
        r.host_ms += cal.host_step_ms
    r.step_ms = r.compute_ms + r.exposed_ms + r.bubble_ms + r.host_ms
    if not math.isfinite(r.step_ms):
        raise v.ConfigError(f"the calibrated step is {r.step_ms}: the trace's numbers are out of range")
    r.notes.append(f"calibrated: {cal.summary().splitlines()[0]}")
    return r


def terms(measured: Measured, report: StepReport) -> dict:
    """{term: (measured ms, predicted ms)} of one step: compute; exposed communication of the engines' kinds
    (the pipeline's aside); the pipeline (bubble and exposed pipeline transfers); host (idle time, and the
    exposed time of collectives no engine names). Where a miss comes from."""
    exposed = pipeline = other = 0.0
    for kind, (_comm, exp, _calls, _nbytes) in measured.comm.items():
        if kind in PIPELINE_KINDS:
            pipeline += exp
        elif engine_of(kind) is not None or model_kind(kind, report.comm_by_kind, measured.comm) is not None:
            exposed += exp
        else:
            other += exp
    pred_pipe = report.bubble_ms + sum(report.exposed_by_kind.get(k, 0.0) for k in PIPELINE_KINDS)
    pred_exposed = sum(e for k, e in report.exposed_by_kind.items() if k not in PIPELINE_KINDS)
    return {"compute": (measured.compute_ms, report.compute_ms), "exposed": (exposed, pred_exposed),
            "pipeline": (pipeline, pred_pipe), "host": (measured.idle_ms + other, report.host_ms)}
