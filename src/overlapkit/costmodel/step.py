"""One training step, predicted: compute, communication, and what overlap hides of it.

    T_step = T_compute + T_exposed + T_bubble
    T_exposed = Σ over kinds of what each collective leaves un-hidden (contention included)
    r(kind)   = 1 − exposed(kind) / comm(kind)

Per layer and micro-batch, every TP collective is a `Site` the planner prices (the TP overlap
of each GEMM); DP buckets hide behind the last micro-batch's backward with the last bucket
exposed; ZeRO gathers are prefetched one layer ahead; pipeline sends hide in 1F1B's steady
state and the bubble is (pp − 1)/vpp micro-batch times. The slowest pipeline stage (the one
holding the LM head) sets the pace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from . import _validate as v
from .block import Block
from .collectives import Collectives, Group
from .hardware import DTYPE_BYTES, Hardware
from .host_queue import queue_wait_ms
from .layer import Ctx, embedding_backward_ms, grad_accumulation_ms, layer, lm_head, weight_cast_ms
from .params import rank_params, shards, stage_params  # noqa: F401 (stage_params re-exported)
from .reduction import MIB, data_parallel, dp_group, expert_dp_group, grad_reduction  # noqa: F401 (re-exported)
from .transformer import ModelConfig, ParallelConfig, validate

ADAM_BYTES_PER_PARAM = 30
"""Optimizer step traffic: fp32 master, m, v read and written (24), fp32 grad read, bf16 param written."""
GRAD_NORM_BYTES_PER_PARAM = 8
"""Gradient-norm read for clipping (4) and the fp32 gradient buffer zeroed for the next step (4)."""
ADAM_FP32_PARAMS_BYTES_PER_PARAM = 28
"""The same step over fp32 parameters (autocast): parameter, gradient, m and v read, the three written."""
CLIP_SCALE_BYTES_PER_PARAM = 8
"""torch's clip_grad_norm_ multiplies every gradient by the clipping coefficient, even at 1 (read and write
fp32); Megatron scales only when the norm exceeds the limit."""
FP16_UNSCALE_BYTES_PER_PARAM = 8
"""fp16 loss scaling: the fp32 gradients read and written once more to unscale and check for inf/nan."""
HOST_OPS_PER_LAYER = {False: 20, True: 45}
"""Framework ops the host dispatches for one layer's forward (fused, eager); backward twice as many.
Where their dispatch falls behind the GPU's work over the step so far, the GPU waits for the host (host_queue)."""


@dataclass
class StepReport:
    """The prediction for one step on the slowest pipeline stage, milliseconds."""

    model: ModelConfig
    """The model predicted."""
    par: ParallelConfig
    """How it is split and what overlaps."""
    hardware: str
    """Hardware name."""
    step_ms: float
    """compute_ms + exposed_ms + bubble_ms + host_ms."""
    compute_ms: float
    """Every GEMM, attention, memory-bound op and the optimizer step, nothing else."""
    comm_ms: float
    """All communication, hidden or not."""
    exposed_ms: float
    """What communication adds to the step: un-hidden time plus contention and chunking losses."""
    bubble_ms: float
    """Pipeline fill and drain."""
    comm_by_kind: dict
    """comm_ms per timeline kind (tp_all_gather, dp_all_reduce, ...)."""
    exposed_by_kind: dict
    """exposed_ms per kind."""
    layer_fwd: Block
    """One layer's forward for one micro-batch."""
    layer_bwd: Block
    """One layer's backward (with recomputation) for one micro-batch."""
    head_fwd: Block
    """The LM head's forward on the last stage."""
    head_bwd: Block
    """The LM head's backward."""
    layers_per_stage: int
    """Layers on each pipeline rank (all its virtual stages)."""
    optimizer_ms: float = 0.0
    """The optimizer's step itself, what torch.optim's `Optimizer.step` range holds (part of compute_ms)."""
    step_end_ms: float = 0.0
    """Around it: the clipping norm, the gradients zeroed, torch's clipping scale (part of compute_ms)."""
    param_passes_ms: float = 0.0
    """Every pass over the parameters a step but the optimizer's: step_end_ms, autocast's casts, gradient
    accumulation outside the GEMM (part of compute_ms; a calibration prices them at the optimizer's rate)."""
    host_ms: float = 0.0
    """Time the GPU waits for the host to dispatch kernels (small layers, eager PyTorch)."""
    stage_ms: tuple = ()
    """One micro-batch's forward + backward on each pipeline stage, first to last."""
    stage_layers: tuple = ()
    """Layers of each pipeline stage."""
    zero3: dict = field(default_factory=dict)
    """ZeRO-3: the prefetch depth and wrap used, and why."""
    memory: dict = field(default_factory=dict)
    """Estimated memory per GPU (memory.estimate) and whether it fits."""
    peak_tflops: float = 0.0
    """The GPU's dense matrix peak in the step's dtype (for MFU)."""
    flops_convention: str = "megatron2024"
    """FLOP count behind the reported TFLOP/s per GPU and MFU (flops.CONVENTIONS)."""
    notes: list = field(default_factory=list)
    """Where overlap cannot help, and switches that would not gain."""
    recommendations: list = field(default_factory=list)
    """advice.Recommendation rows, best first."""

    def r(self, kind: str) -> float:
        """Overlap ratio of one kind: the share of its communication that was hidden."""
        comm = self.comm_by_kind.get(kind, 0.0)
        return 1.0 - self.exposed_by_kind.get(kind, 0.0) / comm if comm > 0 else 1.0

    def pipeline(self) -> dict:
        """Predicted bubble and pipeline-send exposure (what a measured pipeline run is compared with)."""
        par, step = self.par, self.step_ms
        comm, exposed = self.comm_by_kind.get("pp_send", 0.0), self.exposed_by_kind.get("pp_send", 0.0)
        return {"schedule": "interleaved-1f1b" if par.vpp > 1 else "1f1b", "overlap_p2p": par.overlap.pp != "none",
                "bubble_s": self.bubble_ms * 1e-3, "bubble_fraction": self.bubble_ms / step if step else 0.0,
                "ideal_bubble_fraction": (par.pp - 1) / (par.vpp * par.micro_batches + par.pp - 1),
                "p2p_comm_s": comm * 1e-3, "p2p_exposed_s": exposed * 1e-3,
                "p2p_exposed_fraction": exposed / comm if comm else 0.0}

    def to_dict(self) -> dict:
        from dataclasses import fields

        from .flops import throughput

        s = 1e-3
        kinds = sorted(self.comm_by_kind)
        parallel = {f.name: getattr(self.par, f.name) for f in fields(self.par) if f.name != "overlap"}
        return {
            "model": self.model.name, "hardware": self.hardware,
            "parallel": parallel | {"overlap": vars(self.par.overlap).copy(), "micro_batches": self.par.micro_batches,
                                    "world": self.par.world},
            "step_time_s": self.step_ms * s, "compute_s": self.compute_ms * s, "comm_s": self.comm_ms * s,
            "exposed_comm_s": self.exposed_ms * s, "bubble_s": self.bubble_ms * s, "host_s": self.host_ms * s,
            "optimizer_s": self.optimizer_ms * s, "step_end_s": self.step_end_ms * s,
            "throughput": throughput(self.model, self.par, self.step_ms * s, self.peak_tflops, self.flops_convention),
            "memory": dict(self.memory),
            "pipeline": self.pipeline() if self.par.pp > 1 else {},
            "zero3": dict(self.zero3),
            "by_kind": {k: {"comm_s": self.comm_by_kind[k] * s, "exposed_s": self.exposed_by_kind.get(k, 0.0) * s,
                            "r": self.r(k)} for k in kinds},
            "layers_per_stage": self.layers_per_stage, "stage_layers": list(self.stage_layers),
            "stage_s": [t * s for t in self.stage_ms],
            "layer_rows": [dict(r, phase="fwd") for r in self.layer_fwd.rows]
            + [dict(r, phase="bwd") for r in self.layer_bwd.rows],
            "head_rows": [dict(r, phase="fwd") for r in self.head_fwd.rows]
            + [dict(r, phase="bwd") for r in self.head_bwd.rows],
            "notes": list(self.notes),
            "recommendations": [vars(r).copy() for r in self.recommendations],
        }

def predict(model: ModelConfig, par: ParallelConfig, hw: Hardware, coll: Collectives | None = None,
            gpus: int | None = None) -> StepReport:
    """Predict one training step; raises ConfigError (naming the field) on sizes that don't fit."""
    from .memory import estimate

    validate(model, par, hw.gpus_per_node, hw.name, gpus)
    hw = hw.for_training()
    coll = coll or Collectives(hw)
    ctx = Ctx(model, par, hw, coll)
    layer_f, layer_b = layer(ctx, Block)
    head_f, head_b = lm_head(ctx, Block)
    emb = Block()
    emb.add_compute("embedding gradient (dense, fp32 accumulate)", embedding_backward_ms(ctx))
    layers = par.stage_layers(model.num_layers)
    ranks = [rank_params(model, par, i) for i in range(par.pp)]
    params = [r.total for r in ranks]
    # Per layer, the weights' own passes (autocast's casts, accumulation outside the GEMM) run inline with the
    # layer's kernels; the rest of a stage's parameters (embedding, head) are done before and after its layers.
    lp = model.dense_layer_params / par.tp + model.expert_layer_params / (par.tp * par.ep)
    cast_f, cast_b = weight_cast_ms(ctx, lp)
    acc_layer = grad_accumulation_ms(ctx, lp)
    per_layer = (cast_f, cast_b + acc_layer)  # GPU ms a layer adds (forward, backward)
    stages, heads, tails = [], [], []  # GPU ms a stage adds before and after its layers, each micro-batch
    passes = []  # GPU ms of a stage's passes over its parameters, each micro-batch
    for i, n in enumerate(layers):
        f = layer_f.scaled(n) + (head_f if i == par.pp - 1 else Block())
        b = layer_b.scaled(n) + (head_b if i == par.pp - 1 else Block()) + (emb if i == 0 else Block())
        # the input embedding's table is looked up, never cast (F.embedding is not on autocast's list), unless
        # the LM head on the same rank multiplies by it (tied embeddings, one stage)
        rest = params[i] - n * lp
        looked_up = i == 0 and not (model.tied_embeddings and i == par.pp - 1)
        rest_f, rest_b = weight_cast_ms(ctx, rest - (model.vocab_size * model.hidden / par.tp if looked_up else 0))
        acc_rest = grad_accumulation_ms(ctx, rest)
        if acc := n * acc_layer + acc_rest:
            b.add_compute(f"gradient accumulation ({par.grad_accumulation})", acc)
        if cast_f or rest_f:
            f.add_compute("weight cast to the compute dtype (autocast)", n * cast_f + rest_f)
            b.add_compute("weight gradient cast to fp32 (autocast)", n * cast_b + rest_b)
        stages.append((f, b))
        passes.append(acc + n * (cast_f + cast_b) + rest_f + rest_b)
        heads.append(rest_f)
        tails.append((emb.wall_ms if i == 0 else 0.0) + acc_rest + rest_b)
    slowest = max(range(par.pp), key=lambda i: stages[i][0].wall_ms + stages[i][1].wall_ms)
    fwd, bwd = stages[slowest]
    m = par.micro_batches
    ops = HOST_OPS_PER_LAYER[par.eager]
    dispatch = ops * hw.host_us_per_op * 1e-3  # one layer's forward; its backward launches twice as many

    def launches(i: int, micro_batches: int) -> list[tuple[float, float, int]]:
        """Stage i's units in launch order, (host ms, GPU ms, ops): its layers forward, the head, backward."""
        last = i == par.pp - 1
        head = [(0.0, head_f.wall_ms, 0), (0.0, head_b.wall_ms, 0)] if last else []
        one = ([(0.0, heads[i], 0)] if heads[i] > 0 else []) + [(dispatch, layer_f.wall_ms + per_layer[0], ops)] * layers[i]
        one += head + [(2 * dispatch, layer_b.wall_ms + per_layer[1], 2 * ops)] * layers[i]
        return (one + ([(0.0, tails[i], 0)] if tails[i] > 0 else [])) * micro_batches

    waits = [queue_wait_ms(launches(i, 1)) for i in range(par.pp)]
    times = [f.wall_ms + b.wall_ms + w for (f, b), w in zip(stages, waits)]
    step = (fwd + bwd).scaled(m)
    notes: list[str] = []
    # 1F1B: the slowest stage runs m micro-batches; the others' fill and drain add their own times
    # once (uniform stages: (pp - 1)/vpp micro-batch times).
    bubble = (sum(times) - times[slowest]) / par.vpp
    if par.pp > 1:
        bubble += _pipeline_p2p(ctx, step, notes)
    zero3: dict = {}
    if par.dp * par.cp > 1:
        zero3 = data_parallel(ctx, step, ranks, stages, slowest, layer_f, layer_b, layers[slowest], notes)
    dense_dp, expert_dp = shards(par) if par.zero else (1, 1)
    autocast = par.weights == "autocast"
    per_param = ((ADAM_FP32_PARAMS_BYTES_PER_PARAM if autocast else ADAM_BYTES_PER_PARAM)
                 + (FP16_UNSCALE_BYTES_PER_PARAM if par.dtype == "fp16" else 0))
    stepped = ranks[slowest].dense / dense_dp + ranks[slowest].expert / expert_dp
    ms_per_byte = stepped / (hw.memory.elementwise_gbps * 1e6)  # a pass of one byte over each stepped parameter
    optimizer = per_param * ms_per_byte
    # outside torch.optim's step range (what a trace's Optimizer.step holds): the norm, the zeroing, and under
    # autocast torch's clipping scale over the whole gradient
    clip = CLIP_SCALE_BYTES_PER_PARAM * ms_per_byte if autocast else 0.0
    step_end = GRAD_NORM_BYTES_PER_PARAM * ms_per_byte + clip
    if clip:
        notes.append(f"clip_grad_norm_'s scale of every gradient: {clip:.3g} ms")
    # the optimizer's kernels follow the backward's, after the host's own time in its step (calibrated)
    host = queue_wait_ms(launches(slowest, m) + [(hw.optimizer_host_ms, step_end + optimizer, 0)])
    compute = step.compute_ms + optimizer + step_end
    exposed = sum(step.exposed.values())
    report = StepReport(model, par, hw.name, compute + exposed + bubble + host, compute, sum(step.comm.values()),
                        exposed, bubble, dict(step.comm), dict(step.exposed), layer_f, layer_b, head_f, head_b,
                        layers[slowest], optimizer, step_end, passes[slowest] * m + step_end, notes=notes, host_ms=host, stage_ms=tuple(times),
                        stage_layers=tuple(layers), zero3=zero3, peak_tflops=hw.peak_tflops(par.dtype))
    for name in ("step_ms", "compute_ms", "comm_ms", "exposed_ms", "bubble_ms", "host_ms"):
        if not math.isfinite(getattr(report, name)):
            raise v.ConfigError(f"the predicted {name[:-3]} time is {getattr(report, name)}: an input is out of "
                                f"range (a link latency or bandwidth, a size); check the hardware and model files")
    report.memory = estimate(model, par, hw, zero3.get("prefetch", 0))
    if not report.memory["fits"]:
        notes.append(f"memory: {report.memory['total_gib']:.1f} GiB per GPU estimated, more than the "
                     f"{hw.hbm_gib:.0f} GiB of {hw.name}: this configuration does not fit")
    return report


def p2p_ms(model: ModelConfig, par: ParallelConfig, hw: Hardware, coll: Collectives) -> float:
    """One pipeline send/recv of a micro-batch's activations (SP-sharded, or split over TP and re-gathered)."""
    full = par.micro_batch * model.seq_len // par.cp * model.hidden * DTYPE_BYTES[par.dtype]
    link = Group.strided(2, par.tp * par.cp * par.dp, hw.gpus_per_node)
    if par.sp or par.tp == 1:
        return coll.time_ms("send_recv", full // par.tp, link)
    if par.pp_scatter_gather:  # each TP rank sends 1/tp; an NVLink all-gather re-assembles it
        return coll.time_ms("send_recv", full // par.tp, link) + coll.time_ms("all_gather", full, Group(par.tp, par.tp))
    return coll.time_ms("send_recv", full, link)


def _pipeline_p2p(ctx: Ctx, step: Block, notes: list) -> float:
    """Price the pipeline's sends into `step`; returns what they add to the bubble (without overlap the
    steady-state transfers are exposed on the stage itself, and the fill and drain wait for theirs too)."""
    par = ctx.par
    t = p2p_ms(ctx.model, par, ctx.hw, ctx.coll)
    transfers = 2 * par.vpp * par.micro_batches  # activation in, gradient in, per model chunk
    # The fill and the drain pass each activation down and each gradient up through pp - 1 hops that no
    # stage's compute hides (1F1B's warm-up waits on them, Megatron's schedules.py); with overlap the
    # steady-state transfers hide behind the other micro-batch, without it each is paid once more.
    fill_drain = 2 * (par.pp - 1) * t
    exposed = t * transfers if par.overlap.pp == "none" else fill_drain
    step.add_comm("pp_send", t * transfers, exposed)
    if ctx.model.tied_embeddings:
        # the first stage's embedding and the last stage's head are one weight: Megatron all-reduces its
        # gradient between the two stages after the flush (finalize_model_grads, the embedding group)
        table = ctx.model.vocab_size * ctx.model.hidden / par.tp * max(par.grad_bytes, ctx.db)
        ends = Group.strided(2, par.tp * par.cp * par.dp * (par.pp - 1), ctx.hw.gpus_per_node)
        ms = ctx.coll.time_ms("all_reduce", table, ends)
        step.add_comm("pp_embedding_all_reduce", ms, ms)
    if par.overlap.pp != "none" and par.vpp == 1:
        notes.append("pp: Megatron's overlap_p2p_comm needs the interleaved schedule (vpp > 1)")
    return fill_drain if par.overlap.pp == "none" else 0.0
