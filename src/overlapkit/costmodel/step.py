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
from .collectives import Collectives, Group
from .hardware import DTYPE_BYTES, Hardware
from .layer import Ctx, embedding_backward_ms, grad_accumulation_ms, layer, lm_head
from .overlap import bucket_sizes, buckets_ms, layered_ms
from .planner import SiteChoice
from .transformer import ModelConfig, ParallelConfig, validate

MIB = 2**20
ADAM_BYTES_PER_PARAM = 30
"""Optimizer step traffic: fp32 master, m, v read and written (24), fp32 grad read, bf16 param written."""
GRAD_NORM_BYTES_PER_PARAM = 8
"""Gradient-norm read for clipping (4) and the fp32 gradient buffer zeroed for the next step (4)."""
FP16_UNSCALE_BYTES_PER_PARAM = 8
"""fp16 loss scaling: the fp32 gradients read and written once more to unscale and check for inf/nan."""
HOST_OPS_PER_LAYER = {False: 20, True: 45}
"""Framework ops the host dispatches for one layer's forward (fused, eager); backward twice as many.
While the GPU's work per layer is shorter than their dispatch, the GPU waits for the host."""


@dataclass
class Block:
    """Work of one layer (or the LM head) for one micro-batch, in one phase."""

    compute_ms: float = 0.0
    """Pure compute: every GEMM, attention and memory-bound op, nothing else."""
    wall_ms: float = 0.0
    """Time on the critical path: compute plus what its collectives leave exposed."""
    comm: dict = field(default_factory=dict)
    """Communication time per kind."""
    exposed: dict = field(default_factory=dict)
    """Exposed time per kind."""
    rows: list = field(default_factory=list)
    """Report rows, one per GEMM/site/op."""
    host_ms: float = 0.0
    """Time the GPU waits for the host's dispatch (one layer; not in wall_ms)."""

    def add_compute(self, name: str, ms: float) -> None:
        self.compute_ms += ms
        self.wall_ms += ms
        self.rows.append({"op": name, "time_ms": ms, "gemm_ms": ms})

    def add_comm(self, kind: str, comm_ms: float, exposed_ms: float) -> None:
        self.comm[kind] = self.comm.get(kind, 0.0) + comm_ms
        self.exposed[kind] = self.exposed.get(kind, 0.0) + exposed_ms
        self.wall_ms += exposed_ms

    def add_site(self, c: SiteChoice) -> None:
        self.compute_ms += c.gemm_ms
        self.wall_ms += c.gemm_ms
        self.add_comm(c.kind, c.comm_ms, c.exposed_ms)
        s = c.site
        self.rows.append({"op": s.name, "m": s.m, "k": s.k, "n": s.n, "gemm_ms": c.gemm_ms,
                          "comm": c.kind, "comm_ms": c.comm_ms, "pattern": s.pattern, "mode": c.mode,
                          "chunks": c.chunks, "time_ms": c.time_ms, "exposed_ms": c.exposed_ms, "note": c.note,
                          "chunk_ms": c.chunk_ms, "piece_ms": c.piece_ms, "contention": c.contention,
                          "group_size": c.group_size, "nbytes": s.nbytes})

    def scaled(self, times: float) -> "Block":
        return Block(self.compute_ms * times, self.wall_ms * times,
                     {k: x * times for k, x in self.comm.items()},
                     {k: x * times for k, x in self.exposed.items()}, self.rows)

    def __add__(self, other: "Block") -> "Block":
        keys = set(self.comm) | set(other.comm)
        return Block(self.compute_ms + other.compute_ms, self.wall_ms + other.wall_ms,
                     {k: self.comm.get(k, 0.0) + other.comm.get(k, 0.0) for k in keys},
                     {k: self.exposed.get(k, 0.0) + other.exposed.get(k, 0.0) for k in keys},
                     self.rows + other.rows)


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
    """The optimizer step (part of compute_ms)."""
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
            "optimizer_s": self.optimizer_ms * s,
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

def _host_wait(block: Block, ops: int, host_us: float) -> Block:
    """The layer's wall time when the host's dispatch of its ops outlasts the GPU's work."""
    host = ops * host_us * 1e-3
    if host > block.wall_ms:
        block.rows.append({"op": f"host dispatch of {ops} ops (GPU waits)", "time_ms": host - block.wall_ms,
                           "gemm_ms": 0.0})
        block.host_ms = host - block.wall_ms
    return block


def predict(model: ModelConfig, par: ParallelConfig, hw: Hardware, coll: Collectives | None = None,
            gpus: int | None = None) -> StepReport:
    """Predict one training step; raises ConfigError (naming the field) on sizes that don't fit."""
    from .memory import estimate

    validate(model, par, hw.gpus_per_node, hw.name, gpus)
    hw = hw.for_training()
    coll = coll or Collectives(hw)
    ctx = Ctx(model, par, hw, coll)
    layer_f, layer_b = layer(ctx, Block)
    ops = HOST_OPS_PER_LAYER[par.eager]
    layer_f, layer_b = _host_wait(layer_f, ops, hw.host_us_per_op), _host_wait(layer_b, 2 * ops, hw.host_us_per_op)
    head_f, head_b = lm_head(ctx, Block)
    emb = Block()
    emb.add_compute("embedding gradient (dense, fp32 accumulate)", embedding_backward_ms(ctx))
    layers = par.stage_layers(model.num_layers)
    params = [stage_params(model, par, i) / par.tp for i in range(par.pp)]
    stages = []
    for i, n in enumerate(layers):
        f = layer_f.scaled(n) + (head_f if i == par.pp - 1 else Block())
        b = layer_b.scaled(n) + (head_b if i == par.pp - 1 else Block()) + (emb if i == 0 else Block())
        if acc := grad_accumulation_ms(ctx, params[i]):
            b.add_compute(f"gradient accumulation ({par.grad_accumulation})", acc)
        stages.append((f, b))
    slowest = max(range(par.pp), key=lambda i: stages[i][0].wall_ms + stages[i][1].wall_ms)
    fwd, bwd = stages[slowest]
    host_layer = layer_f.host_ms + layer_b.host_ms
    times = [f.wall_ms + b.wall_ms + n * host_layer for (f, b), n in zip(stages, layers)]
    m = par.micro_batches
    step = (fwd + bwd).scaled(m)
    notes: list[str] = []
    # 1F1B: the slowest stage runs m micro-batches; the others' fill and drain add their own times
    # once (uniform stages: (pp - 1)/vpp micro-batch times).
    bubble = (sum(times) - times[slowest]) / par.vpp
    if par.pp > 1:
        _pipeline_p2p(ctx, step, notes)
    zero3: dict = {}
    if par.dp * par.cp > 1:
        zero3 = _data_parallel(ctx, step, params, stages, slowest, layer_f, layer_b, layers[slowest], notes)
    shards = par.dp * par.cp if par.zero else 1
    per_param = ADAM_BYTES_PER_PARAM + GRAD_NORM_BYTES_PER_PARAM + (FP16_UNSCALE_BYTES_PER_PARAM if par.dtype == "fp16" else 0)
    optimizer = params[slowest] / shards * per_param / (hw.memory.elementwise_gbps * 1e6)
    host = m * host_layer * layers[slowest]
    compute = step.compute_ms + optimizer
    exposed = sum(step.exposed.values())
    report = StepReport(model, par, hw.name, compute + exposed + bubble + host, compute, sum(step.comm.values()),
                        exposed, bubble, dict(step.comm), dict(step.exposed), layer_f, layer_b, head_f, head_b,
                        layers[slowest], optimizer, notes=notes, host_ms=host, stage_ms=tuple(times),
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


def stage_params(model: ModelConfig, par: ParallelConfig, stage: int | None = None) -> int:
    """Parameters of a pipeline stage (default: the last, with the LM head), before TP sharding."""
    stage = par.pp - 1 if stage is None else stage
    n = par.stage_layers(model.num_layers)[stage] * model.layer_params
    if par.pp == 1:
        return n + model.embedding_params
    table = model.vocab_size * model.hidden
    return n + (table if stage == 0 else 0) + (table if stage == par.pp - 1 else 0)


def p2p_ms(model: ModelConfig, par: ParallelConfig, hw: Hardware, coll: Collectives) -> float:
    """One pipeline send/recv of a micro-batch's activations (SP-sharded, or split over TP and re-gathered)."""
    full = par.micro_batch * model.seq_len // par.cp * model.hidden * DTYPE_BYTES[par.dtype]
    link = Group.strided(2, par.tp * par.cp * par.dp, hw.gpus_per_node)
    if par.sp or par.tp == 1:
        return coll.time_ms("send_recv", full // par.tp, link)
    if par.pp_scatter_gather:  # each TP rank sends 1/tp; an NVLink all-gather re-assembles it
        return coll.time_ms("send_recv", full // par.tp, link) + coll.time_ms("all_gather", full, Group(par.tp, par.tp))
    return coll.time_ms("send_recv", full, link)


def dp_group(par: ParallelConfig, hw: Hardware) -> Group:
    """The gradient-reduction group: data-parallel and context-parallel ranks, tp apart."""
    return Group.strided(par.dp * par.cp, par.tp, hw.gpus_per_node)


def grad_reduction(par: ParallelConfig) -> tuple[str, str]:
    """(timeline kind, collective) of the gradient reduction: all-reduce, or reduce-scatter under ZeRO."""
    return ("dp_all_reduce", "all_reduce") if par.zero == 0 else ("dp_reduce_scatter", "reduce_scatter")


def _pipeline_p2p(ctx: Ctx, step: Block, notes: list) -> None:
    par = ctx.par
    t = p2p_ms(ctx.model, par, ctx.hw, ctx.coll)
    transfers = 2 * par.vpp * par.micro_batches  # activation in, gradient in, per model chunk
    # With overlap only the warm-up and cool-down transfers stay on the critical path.
    exposed = t * transfers if par.overlap.pp == "none" else 2 * (par.pp - 1) * t
    step.add_comm("pp_send", t * transfers, exposed)
    if par.overlap.pp != "none" and par.vpp == 1:
        notes.append("pp: Megatron's overlap_p2p_comm needs the interleaved schedule (vpp > 1)")


def _reduction_exposed(ctx: Ctx, grad_bytes: float, hide_ms: float, notes: list | None) -> tuple[float, float]:
    """(comm, exposed) of one stage's bucketed gradient reduction behind `hide_ms` of backward."""
    par, coll, group = ctx.par, ctx.coll, dp_group(ctx.par, ctx.hw)
    _, name = grad_reduction(par)
    sizes = bucket_sizes(grad_bytes, par.bucket_mib * MIB)
    total = sum(coll.time_ms(name, b, group) for b in sizes)
    if par.overlap.dp == "none":
        return total, total
    exposed = buckets_ms(sizes, hide_ms, lambda b: coll.time_ms(name, b, group), ctx.hw.sm_comm_slowdown) - hide_ms
    if notes is not None and total > hide_ms:
        notes.append(f"dp: gradient {name.replace('_', '-')} ({total:.1f} ms) outlasts the backward that "
                     f"hides it ({hide_ms:.1f} ms): overlap cannot hide more; accumulate more "
                     f"micro-batches per step or shrink the gradients")
    return total, exposed


def _chunked_reduction_exposed(ctx: Ctx, grad_bytes: float, stage_bwd_ms: float) -> tuple[float, float]:
    """(comm, exposed) of an interleaved stage's reduction, one model chunk at a time.

    Megatron enables the gradient sync of each model chunk at its own last backward. In the
    interleaved cool-down the last backwards run chunk by chunk, vpp-1 first and chunk 0 last,
    each chunk's pp micro-batches apart: chunk c's gradients are complete c·pp chunk-backwards
    before the stage's end, and its buckets reduce while the later chunks still compute. One
    comm stream carries the chunks in that order; exposed is what runs past the stage's end."""
    par = ctx.par
    chunk_bwd = stage_bwd_ms / par.vpp
    comm_total, stream_free = 0.0, -math.inf
    for c in range(par.vpp - 1, -1, -1):
        start = -(c * par.pp + 1) * chunk_bwd  # the chunk's last backward begins (0 = the stage's end)
        comm, exposed = _reduction_exposed(ctx, grad_bytes / par.vpp, chunk_bwd, None)
        comm_total += comm
        stream_free = max(start + chunk_bwd + exposed, stream_free + comm)
    return comm_total, max(0.0, stream_free)


def _data_parallel(ctx: Ctx, step: Block, params: list, stages: list, slowest: int, layer_f: Block,
                   layer_b: Block, per_stage: int, notes: list) -> dict:
    """Gradient reduction, ZeRO gathers: bucketed behind backward, prefetched before forward."""
    par, hw, coll = ctx.par, ctx.hw, ctx.coll
    group = dp_group(par, hw)
    layer_param_bytes = ctx.model.layer_params / par.tp * ctx.db
    if par.zero == 3:
        return _zero3(ctx, step, group, layer_f, layer_b, per_stage, notes)
    kind, _ = grad_reduction(par)
    # Each stage reduces behind its own last backward. Inside the drain, stage i finishes that
    # backward before stage 0 does by the last backwards of stages i-1 .. 0, and its reduction may use them.
    candidates = {0, slowest, par.pp - 1} if par.dp_in_drain else {slowest}
    worst, total = 0.0, 0.0
    for i in sorted(candidates):
        bwd = stages[i][1].wall_ms
        if par.vpp > 1 and par.overlap.dp != "none":
            comm, exposed = _chunked_reduction_exposed(ctx, params[i] * par.grad_bytes, bwd)
        else:
            comm, exposed = _reduction_exposed(ctx, params[i] * par.grad_bytes, bwd, notes if i == slowest else None)
        if i == slowest:
            total = comm
        slack = sum(stages[j][1].wall_ms for j in range(i)) if par.dp_in_drain else 0.0
        worst = max(worst, exposed - slack)
    step.add_comm(kind, total, max(0.0, worst))
    if par.zero in (1, 2):  # parameters gathered after the sharded step, before the next forward
        gathers = [coll.time_ms("all_gather", layer_param_bytes, group)] * per_stage
        t = sum(gathers)
        if par.overlap.zero == "none":
            exp = t
        else:
            exp = layered_ms(gathers, [layer_f.wall_ms] * per_stage, [0.0] * per_stage, hw.sm_comm_slowdown) \
                - per_stage * layer_f.wall_ms
        step.add_comm("zero_all_gather", t, max(0.0, exp))
    return {}


def _zero3(ctx: Ctx, step: Block, group: Group, layer_f: Block, layer_b: Block, per_stage: int, notes: list) -> dict:
    """ZeRO-3 / FSDP: per unit of `zero3_wrap` layers, gathered in forward and backward, gradients
    reduce-scattered in backward, gathers issued `zero3_prefetch` units ahead (or chosen)."""
    from .fsdp import fsdp_prefetch_choice, prefetch_wall_ms
    from .memory import estimate

    par, coll, slow = ctx.par, ctx.coll, ctx.hw.sm_comm_slowdown
    wrap = min(par.zero3_wrap, per_stage)
    units = max(1, per_stage // wrap)
    unit_params = ctx.model.layer_params / par.tp * wrap
    ag = coll.time_ms("all_gather", unit_params * ctx.db, group)
    rs = coll.time_ms("reduce_scatter", unit_params * par.grad_bytes, group)
    f_ms, b_ms = layer_f.wall_ms * wrap, layer_b.wall_ms * wrap
    if par.overlap.zero == "none":
        depth, why = 0, "overlap.zero=none: every gather waits for the previous unit"
    elif par.zero3_prefetch >= 0:
        depth, why = par.zero3_prefetch, "as asked (--zero3-prefetch)"
    else:
        free = (ctx.hw.hbm_gib * 2**30 - estimate(ctx.model, par, ctx.hw, 0)["total_bytes"])
        depth, why = fsdp_prefetch_choice(b_ms, ag, unit_params * ctx.db, max(0.0, free), num_layers=units,
                                          reduce_ms=rs, contention=slow)
    wall_f = prefetch_wall_ms(f_ms, ag, depth, num_layers=units, contention=slow)
    wall_b = prefetch_wall_ms(b_ms, ag, depth, num_layers=units, reduce_ms=rs, contention=slow)
    exp_f, exp_b = wall_f - units * f_ms, wall_b - units * b_ms
    m = par.micro_batches
    step.add_comm("zero_all_gather", m * 2 * units * ag, m * max(0.0, exp_f + exp_b * ag / (ag + rs)))
    step.add_comm("dp_reduce_scatter", m * units * rs, m * max(0.0, exp_b * rs / (ag + rs)))
    notes.append(f"zero3: prefetch depth {depth}, {wrap} layer(s) per unit: {why}")
    return {"prefetch": depth, "wrap_layers": wrap, "units": units, "reason": why,
            "gather_ms": ag, "reduce_scatter_ms": rs}
