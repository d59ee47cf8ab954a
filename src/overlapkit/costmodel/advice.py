"""Which overlap switch to turn on next, its prerequisite, and what it is predicted to save.

Each candidate switch is tried on the model and kept if the step gets faster, as in a
decision table: what you want hidden, the switch, what it needs, the predicted saving. The
prediction also says where overlap cannot help (communication longer than the compute that
could hide it, chunks too small to run fast, all-reduces on the critical path).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .collectives import Collectives
from .hardware import Hardware, load_hardware
from .step import StepReport, predict
from .transformer import ModelConfig, ParallelConfig, load_model

MIN_GAIN = 0.005
"""A switch saving less than this share of the step is reported as no gain."""


@dataclass(frozen=True)
class Recommendation:
    """One row of the decision table."""

    want: str
    """What it hides."""
    switch: str
    """What to turn on (our setting; the Megatron/PyTorch equivalent in parentheses)."""
    prerequisite: str
    """What it needs to work."""
    saving_s: float
    """Predicted step-time saving, seconds (negative: it would be slower)."""
    saving_pct: float
    """Saving as a percentage of the current step."""


def _candidates(model: ModelConfig, par: ParallelConfig):
    """(want, switch, prerequisite, changed ParallelConfig) for every switch that applies."""
    ov = par.overlap
    if par.tp > 1 and not par.sp:
        yield ("TP all-reduces made overlappable", "sp=True (--sequence-parallel)",
               "TP inside one NVLink node", replace(par, sp=True))
    if par.tp > 1 and ov.tp == "none":
        yield ("backward TP collectives behind the independent dgrad/wgrad GEMMs",
               "overlap.tp=bulk (Megatron default async all-reduce/RS + tp_comm_bulk_dgrad/wgrad)",
               "CUDA_DEVICE_MAX_CONNECTIONS=1", replace(par, overlap=replace(ov, tp="bulk")))
    if par.tp > 1 and par.sp and ov.tp in ("none", "bulk"):
        yield ("forward SP all-gather/reduce-scatter inside the GEMMs (per-GEMM chunks)",
               "overlap.tp=auto (--tp-comm-overlap; torch symm_mem fused ops)",
               "sequence parallelism, TP inside one NVLink node, userbuffers or symmetric memory",
               replace(par, overlap=replace(ov, tp="auto")))
    if par.tp > 1 and par.tp_transport == "p2p" and ov.tp in ("pipelined", "auto"):
        yield ("pipelined TP chunks moved by copy engines, leaving every SM to the GEMM",
               "tp_transport=symm_mem (PyTorch async-TP)", "NVSwitch (all GPU pairs on NVLink), one node",
               replace(par, tp_transport="symm_mem"))
    if par.dp > 1 and ov.dp == "none":
        yield ("gradient reduction inside backward, bucket by bucket",
               "overlap.dp=bulk (DDP buckets; --overlap-grad-reduce)",
               "reduce only on the last micro-batch (no_sync); 25 MiB buckets",
               replace(par, overlap=replace(ov, dp="bulk")))
    if par.dp > 1 and par.zero and ov.zero == "none":
        yield ("ZeRO parameter all-gathers behind earlier layers' forward",
               "overlap.zero=pipelined (--overlap-param-gather; FSDP prefetch)",
               "distributed optimizer (zero >= 1)", replace(par, overlap=replace(ov, zero="pipelined")))
    if par.pp > 1 and ov.pp == "none":
        yield ("pipeline send/recv behind the other micro-batch", "overlap.pp=bulk (overlap_p2p_comm)",
               "interleaved schedule (vpp > 1) in Megatron", replace(par, overlap=replace(ov, pp="bulk")))
    if par.pp > 1 and par.vpp == 1 and model.num_layers % (2 * par.pp) == 0 and par.micro_batches % par.pp == 0:
        yield ("a smaller 1F1B bubble: (pp-1)/vpp micro-batch times", "vpp=2 (interleaved 1F1B)",
               "layers divisible by pp*vpp, micro-batches a multiple of pp", replace(par, vpp=2))
    if par.ep > 1 and ov.ep in ("none", "bulk"):
        yield ("MoE dispatch/combine chunked against expert GEMMs", "overlap.ep=pipelined",
               "expert computation split into token chunks", replace(par, overlap=replace(ov, ep="pipelined")))


def recommend(report: StepReport, hw: Hardware, coll: Collectives | None = None) -> tuple[list, list]:
    """(recommendations that save time, switches that would not) for a predicted step."""
    base = report.step_ms
    good, none = [], []
    for want, switch, prereq, par in _candidates(report.model, report.par):
        new = predict(report.model, par, hw, coll)
        saving = base - new.step_ms
        rec = Recommendation(want, switch, prereq, saving * 1e-3, 100 * saving / base)
        (good if saving > MIN_GAIN * base else none).append(rec)
    good.sort(key=lambda r: -r.saving_s)
    return good, none


def cannot_help(report: StepReport) -> list[str]:
    """Where the prediction says overlap cannot help, one line each (deduplicated)."""
    lines = list(report.notes)
    for block in (report.layer_fwd, report.layer_bwd, report.head_fwd, report.head_bwd):
        for row in block.rows:
            if row.get("note"):
                line = f"{row['op']}: {row['note']}"
                if line not in lines:
                    lines.append(line)
    return lines


def plan(model, hardware, par: ParallelConfig, tables=(), gpus: int | None = None,
         flops: str = "megatron2024") -> StepReport:
    """Predict a step and attach recommendations and cannot-help notes: what `overlapkit plan` prints.

    `flops`: the FLOP convention of the TFLOP/s per GPU and MFU reported (flops.CONVENTIONS)."""
    from . import _validate as v
    from .flops import CONVENTIONS

    v.one_of("plan", "flops", flops, CONVENTIONS)
    hw = load_hardware(hardware)
    model = load_model(model)
    coll = Collectives(hw, tuple(tables))
    report = predict(model, par, hw, coll, gpus)
    report.flops_convention = flops
    good, none = recommend(report, hw, coll)
    report.recommendations = good
    report.notes = cannot_help(report) + [
        f"no gain: {r.switch} ({r.saving_pct:+.1f}%)" for r in none]
    return report
