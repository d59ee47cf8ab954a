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

from dataclasses import dataclass, field

from .collectives import Collectives, Group
from .hardware import DTYPE_BYTES, Hardware
from .overlap import bucket_sizes, buckets_ms, layered_ms
from .planner import Site, SiteChoice, plan_site
from .transformer import Gemm, ModelConfig, ParallelConfig, layer_gemms, validate

MIB = 2**20
ADAM_BYTES_PER_PARAM = 30
"""Optimizer step traffic: fp32 master, m, v read and written (24), fp32 grad read, bf16 param written."""


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
    """compute_ms + exposed_ms + bubble_ms."""
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
    notes: list = field(default_factory=list)
    """Where overlap cannot help, and switches that would not gain."""
    recommendations: list = field(default_factory=list)
    """advice.Recommendation rows, best first."""

    def r(self, kind: str) -> float:
        """Overlap ratio of one kind: the share of its communication that was hidden."""
        comm = self.comm_by_kind.get(kind, 0.0)
        return 1.0 - self.exposed_by_kind.get(kind, 0.0) / comm if comm > 0 else 1.0

    def to_dict(self) -> dict:
        s = 1e-3
        kinds = sorted(self.comm_by_kind)
        return {
            "model": self.model.name, "hardware": self.hardware,
            "parallel": {k: getattr(self.par, k) for k in ("tp", "pp", "vpp", "dp", "ep", "sp", "micro_batch",
                                                           "global_batch", "recompute", "zero", "tp_transport", "dtype")}
            | {"overlap": vars(self.par.overlap).copy(), "micro_batches": self.par.micro_batches},
            "step_time_s": self.step_ms * s, "compute_s": self.compute_ms * s, "comm_s": self.comm_ms * s,
            "exposed_comm_s": self.exposed_ms * s, "bubble_s": self.bubble_ms * s,
            "optimizer_s": self.optimizer_ms * s,
            "by_kind": {k: {"comm_s": self.comm_by_kind[k] * s, "exposed_s": self.exposed_by_kind.get(k, 0.0) * s,
                            "r": self.r(k)} for k in kinds},
            "layers_per_stage": self.layers_per_stage,
            "layer_rows": [dict(r, phase="fwd") for r in self.layer_fwd.rows]
            + [dict(r, phase="bwd") for r in self.layer_bwd.rows],
            "head_rows": [dict(r, phase="fwd") for r in self.head_fwd.rows]
            + [dict(r, phase="bwd") for r in self.head_bwd.rows],
            "notes": list(self.notes),
            "recommendations": [vars(r).copy() for r in self.recommendations],
        }


class _Ctx:
    """What every site of one prediction shares."""

    def __init__(self, model: ModelConfig, par: ParallelConfig, hw: Hardware, coll: Collectives) -> None:
        self.model, self.par, self.hw, self.coll = model, par, hw, coll
        self.db = DTYPE_BYTES[par.dtype]
        self.tokens = par.micro_batch * model.seq_len
        self.tp_group = Group(par.tp, par.tp)

    def site(self, name, phase, pattern, collective, m, k, n, nbytes=None) -> SiteChoice:
        nbytes = self.tokens * self.model.hidden * self.db if nbytes is None else nbytes
        return plan_site(Site(name, phase, pattern, collective, nbytes, m, k, n), self.hw, self.coll,
                         self.tp_group, self.par.overlap.tp, self.par.tp_transport, self.par.dtype)

    def gemm(self, m, k, n) -> float:
        return self.hw.gemm_ms(m, k, n, self.par.dtype)


def _gemm_blocks(ctx: _Ctx, g: Gemm, fwd: Block, bwd: Block) -> None:
    """One TP GEMM's forward, dgrad and wgrad, with the collectives they meet."""
    tp, sp = ctx.par.tp, ctx.par.sp
    f, dg, wg = (g.m, g.k, g.n), (g.m, g.n, g.k), (g.k, g.m, g.n)
    if tp == 1:
        fwd.add_compute(f"{g.name} fwd", ctx.gemm(*f))
        bwd.add_compute(f"{g.name} dgrad", ctx.gemm(*dg))
        bwd.add_compute(f"{g.name} wgrad", ctx.gemm(*wg))
    elif g.column and sp:  # gather the input, then: re-gather beside dgrad, reduce-scatter beside wgrad
        fwd.add_site(ctx.site(f"{g.name} fwd", "fwd", "ag_gemm", "all_gather", *f))
        bwd.add_site(ctx.site(f"{g.name} dgrad", "bwd", "beside", "all_gather", *dg))
        bwd.add_site(ctx.site(f"{g.name} wgrad", "bwd", "beside", "reduce_scatter", *wg))
    elif g.column:  # no SP: all-reduce of the input gradient beside wgrad
        fwd.add_compute(f"{g.name} fwd", ctx.gemm(*f))
        bwd.add_compute(f"{g.name} dgrad", ctx.gemm(*dg))
        bwd.add_site(ctx.site(f"{g.name} wgrad", "bwd", "beside", "all_reduce", *wg))
    elif sp:  # reduce-scatter the output; backward gathers the output gradient
        fwd.add_site(ctx.site(f"{g.name} fwd", "fwd", "gemm_rs", "reduce_scatter", *f))
        bwd.add_site(ctx.site(f"{g.name} dgrad", "bwd", "ag_gemm", "all_gather", *dg))
        bwd.add_compute(f"{g.name} wgrad", ctx.gemm(*wg))
    else:
        fwd.add_site(ctx.site(f"{g.name} fwd", "fwd", "gemm_ar", "all_reduce", *f))
        bwd.add_compute(f"{g.name} dgrad", ctx.gemm(*dg))
        bwd.add_compute(f"{g.name} wgrad", ctx.gemm(*wg))


def _layer(ctx: _Ctx) -> tuple[Block, Block]:
    model, par, hw, mem = ctx.model, ctx.par, ctx.hw, ctx.hw.memory
    fwd, bwd = Block(), Block()
    gemms = layer_gemms(model, par)
    for g in gemms:
        _gemm_blocks(ctx, g, fwd, bwd)
    att_f, att_b = hw.attention_ms(par.micro_batch, model.num_heads // par.tp, model.seq_len, model.head_dim, par.dtype)
    fwd.add_compute("attention fwd", att_f)
    bwd.add_compute("attention bwd", att_b)
    sp_tokens = ctx.tokens // par.tp if par.sp else ctx.tokens
    up = gemms[2]
    elementwise = (2 * mem.norm_ms(sp_tokens * model.hidden, ctx.db)
                   + 2 * mem.elementwise_ms(sp_tokens * model.hidden, ctx.db)
                   + mem.elementwise_ms(up.m * up.n // (2 if model.gated_mlp else 1), ctx.db,
                                        3 if model.gated_mlp else 2)
                   + mem.elementwise_ms(ctx.tokens * gemms[0].n, ctx.db, 2))
    fwd.add_compute("norms, residuals, activation, rope", elementwise)
    bwd.add_compute("norms, residuals, activation, rope (backward)", 2 * elementwise)
    if model.num_experts > 1 and par.ep > 1:
        _expert_all_to_all(ctx, fwd, bwd, gemms)
    recompute = Block()  # runs at the start of the layer's backward
    if par.recompute == "selective":
        recompute.add_compute("recompute attention", att_f)
    elif par.recompute == "full":
        recompute = Block(fwd.compute_ms, fwd.wall_ms, dict(fwd.comm), dict(fwd.exposed),
                          [dict(r, op="recompute " + r["op"]) for r in fwd.rows])
    return fwd, recompute + bwd


def _expert_all_to_all(ctx: _Ctx, fwd: Block, bwd: Block, gemms: list[Gemm]) -> None:
    """MoE dispatch and combine around the expert GEMMs, chunked when EP overlap is on."""
    par, model = ctx.par, ctx.model
    group = Group.strided(par.ep, par.tp, ctx.hw.gpus_per_node)
    tokens = ctx.tokens // par.tp if par.sp else ctx.tokens
    a2a = ctx.coll.time_ms("all_to_all", tokens * model.top_k * model.hidden * ctx.db, group)
    expert_fwd = sum(ctx.gemm(g.m, g.k, g.n) for g in gemms[2:])
    chunked = par.overlap.ep in ("pipelined", "auto")
    c = 4 if chunked else 1
    for block, expert_ms in ((fwd, expert_fwd), (bwd, 2 * expert_fwd)):  # backward: dgrad + wgrad
        if chunked:
            wall = layered_ms([a2a / c] * c, [expert_ms / c] * c, [a2a / c] * c, ctx.hw.sm_comm_slowdown, prefetch=c)
            exposed = max(0.0, wall - expert_ms)
        else:
            exposed = 2 * a2a
        block.add_comm("ep_all_to_all", 2 * a2a, exposed)
        block.rows.append({"op": "MoE dispatch + combine (exposed part)", "comm": "ep_all_to_all", "pattern": "exposed",
                           "comm_ms": 2 * a2a, "gemm_ms": 0.0, "time_ms": exposed, "exposed_ms": exposed,
                           "mode": "pipelined" if chunked else "none", "chunks": c, "group_size": par.ep,
                           "nbytes": tokens * model.top_k * model.hidden * ctx.db, "note": "",
                           "contention": ctx.hw.sm_comm_slowdown})


def _lm_head(ctx: _Ctx) -> tuple[Block, Block]:
    model, par = ctx.model, ctx.par
    fwd, bwd = Block(), Block()
    _gemm_blocks(ctx, Gemm("lm_head", ctx.tokens, model.hidden, model.vocab_size // par.tp, True), fwd, bwd)
    ce = ctx.hw.memory.elementwise_ms(ctx.tokens * model.vocab_size // par.tp, 4, 3)
    fwd.add_compute("cross-entropy", ce)
    bwd.add_compute("cross-entropy (backward)", ce)
    return fwd, bwd


def stage_params(model: ModelConfig, par: ParallelConfig) -> int:
    """Parameters of the last pipeline stage (its layers and the LM head), before TP sharding."""
    return model.num_layers // par.pp * model.layer_params + model.vocab_size * model.hidden


def predict(model: ModelConfig, par: ParallelConfig, hw: Hardware, coll: Collectives | None = None,
            gpus: int | None = None) -> StepReport:
    """Predict one training step; raises ConfigError (naming the field) on sizes that don't fit."""
    validate(model, par, hw.gpus_per_node, hw.name, gpus)
    coll = coll or Collectives(hw)
    ctx = _Ctx(model, par, hw, coll)
    layer_f, layer_b = _layer(ctx)
    head_f, head_b = _lm_head(ctx)
    per_stage = model.num_layers // par.pp
    fwd = layer_f.scaled(per_stage) + head_f  # the last stage: the slowest
    bwd = layer_b.scaled(per_stage) + head_b
    m = par.micro_batches
    step = (fwd + bwd).scaled(m)
    notes: list[str] = []
    bubble = (par.pp - 1) / par.vpp * (fwd.wall_ms + bwd.wall_ms)
    if par.pp > 1:
        _pipeline_p2p(ctx, step, notes)
    params_rank = stage_params(model, par) / par.tp
    if par.dp > 1:
        _data_parallel(ctx, step, params_rank, layer_f, layer_b, per_stage, bwd, notes)
    optimizer = params_rank / (par.dp if par.zero else 1) * ADAM_BYTES_PER_PARAM / (hw.memory.elementwise_gbps * 1e6)
    compute = step.compute_ms + optimizer
    exposed = sum(step.exposed.values())
    return StepReport(model, par, hw.name, compute + exposed + bubble, compute, sum(step.comm.values()),
                      exposed, bubble, dict(step.comm), dict(step.exposed), layer_f, layer_b, head_f, head_b,
                      per_stage, optimizer, notes)


def p2p_ms(model: ModelConfig, par: ParallelConfig, hw: Hardware, coll: Collectives) -> float:
    """One pipeline send/recv of a micro-batch's activations (SP-sharded when SP is on)."""
    nbytes = par.micro_batch * model.seq_len * model.hidden * DTYPE_BYTES[par.dtype] // (par.tp if par.sp else 1)
    return coll.time_ms("send_recv", nbytes, Group.strided(2, par.tp * par.dp, hw.gpus_per_node))


def dp_group(par: ParallelConfig, hw: Hardware) -> Group:
    """The data-parallel group: ranks tp apart."""
    return Group.strided(par.dp, par.tp, hw.gpus_per_node)


def grad_reduction(par: ParallelConfig) -> tuple[str, str]:
    """(timeline kind, collective) of the gradient reduction: all-reduce, or reduce-scatter under ZeRO."""
    return ("dp_all_reduce", "all_reduce") if par.zero == 0 else ("dp_reduce_scatter", "reduce_scatter")


def _pipeline_p2p(ctx: _Ctx, step: Block, notes: list) -> None:
    par = ctx.par
    t = p2p_ms(ctx.model, par, ctx.hw, ctx.coll)
    transfers = 2 * par.vpp * par.micro_batches  # activation in, gradient in, per model chunk
    # With overlap only the warm-up and cool-down transfers stay on the critical path.
    exposed = t * transfers if par.overlap.pp == "none" else 2 * (par.pp - 1) * t
    step.add_comm("pp_send", t * transfers, exposed)
    if par.overlap.pp != "none" and par.vpp == 1:
        notes.append("pp: Megatron's overlap_p2p_comm needs the interleaved schedule (vpp > 1)")


def _data_parallel(ctx: _Ctx, step: Block, params_rank: float, layer_f: Block, layer_b: Block,
                   per_stage: int, bwd: Block, notes: list) -> None:
    """Gradient reduction, ZeRO gathers: bucketed behind backward, prefetched before forward."""
    par, hw, coll = ctx.par, ctx.hw, ctx.coll
    group = dp_group(par, hw)
    slow = hw.sm_comm_slowdown
    grad_bytes = params_rank * par.grad_bytes
    layer_param_bytes = ctx.model.layer_params / par.tp * ctx.db
    if par.zero == 3:
        ag = coll.time_ms("all_gather", layer_param_bytes, group)
        rs = coll.time_ms("reduce_scatter", ctx.model.layer_params / par.tp * par.grad_bytes, group)
        n, m = per_stage, par.micro_batches
        if par.overlap.zero == "none":
            exp_ag, exp_rs = 2 * n * ag, n * rs
        else:
            exp_f = layered_ms([ag] * n, [layer_f.wall_ms] * n, [0.0] * n, slow) - n * layer_f.wall_ms
            exp_b = layered_ms([ag] * n, [layer_b.wall_ms] * n, [rs] * n, slow) - n * layer_b.wall_ms
            exp_ag, exp_rs = exp_f + exp_b * ag / (ag + rs), exp_b * rs / (ag + rs)
        step.add_comm("zero_all_gather", m * 2 * n * ag, m * max(0.0, exp_ag))
        step.add_comm("dp_reduce_scatter", m * n * rs, m * max(0.0, exp_rs))
        return
    kind, coll_name = grad_reduction(par)
    sizes = bucket_sizes(grad_bytes, par.bucket_mib * MIB)
    total = sum(coll.time_ms(coll_name, b, group) for b in sizes)
    if par.overlap.dp == "none":
        exposed = total
    else:
        exposed = buckets_ms(sizes, bwd.wall_ms, lambda b: coll.time_ms(coll_name, b, group), slow) - bwd.wall_ms
        if total > bwd.wall_ms:
            notes.append(f"dp: gradient {coll_name.replace('_', '-')} ({total:.1f} ms) outlasts the backward that "
                         f"hides it ({bwd.wall_ms:.1f} ms): overlap cannot hide more; accumulate more "
                         f"micro-batches per step or shrink the gradients")
    step.add_comm(kind, total, exposed)
    if par.zero in (1, 2):  # parameters gathered after the sharded step, before the next forward
        gathers = [coll.time_ms("all_gather", layer_param_bytes, group)] * per_stage
        t = sum(gathers)
        if par.overlap.zero == "none":
            exp = t
        else:
            exp = layered_ms(gathers, [layer_f.wall_ms] * per_stage, [0.0] * per_stage, slow) - per_stage * layer_f.wall_ms
        step.add_comm("zero_all_gather", t, max(0.0, exp))
