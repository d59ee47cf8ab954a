"""One layer and the LM head for one micro-batch: the compute every collective hides behind.

Each TP GEMM meets its collective at a planner `Site`; attention is flash (one fused kernel) or
unfused (score GEMMs plus softmax and dropout passes over b·heads·s² elements); context
parallelism splits the attention and passes key/value blocks around a ring while the block in
hand is attended; memory-bound ops are fused or run one eager kernel per op; recomputation
re-runs what it names at the start of the backward; MoE dispatch/combine are chunked against
the expert GEMMs. Every cost is a `Block` of compute, communication and exposed time.
"""

from __future__ import annotations

from .collectives import Collectives, Group
from .hardware import DTYPE_BYTES, Hardware
from .overlap import CP_SCHEDULES, cp_pass_ms, layered_ms
from .planner import Site, SiteChoice, plan_site
from .transformer import Gemm, ModelConfig, ParallelConfig, layer_gemms

EAGER_PASSES = 3.0
"""Memory traffic of the memory-bound ops run eagerly, relative to fused: an eager RMSNorm alone is
cast, square, mean, rsqrt, two multiplies and a cast back (~7 passes over the activation where a fused
kernel reads and writes once); SwiGLU, RoPE and residuals add 2-3x. A stated estimate."""
UNFUSED_SCORE_PASSES = (4.5, 5.5)
"""Passes over the b·heads·s² score tensor of unfused attention (forward, backward): scaled masked
softmax reads and writes it, dropout reads it and writes it with its mask; backward runs both in
reverse and the score-gradient through the softmax (Megatron-LM 2021's FusedScaleMaskSoftmax + dropout)."""
CE_BYTES = (22.3, 19.4)
"""Bytes per logit of the fp32 cross-entropy (forward, backward): bf16 logits cast to fp32, max,
exp-sum and log-softmax passes, then the gradient softmax − one-hot and its cast back
(PyTorch's and Megatron's vocab-parallel cross-entropy are unfused fp32 passes). Calibrated on our
H200 (calibration.cross_entropy_bytes over benchmarks/results/lm_head_probe_cuda.json's four
shapes: 22.3 and 19.4, at the x + y-fitted 4.28 TB/s; 29.7 and 25.8 at the x + x-miscounted 5.69,
the same times)."""
EMBEDDING_GRAD_BYTES = 10
"""Bytes per embedding-table element per micro-batch: the dense bf16 gradient written, then
accumulated into the fp32 main gradient (read + write)."""


class Ctx:
    """What every site of one prediction shares."""

    def __init__(self, model: ModelConfig, par: ParallelConfig, hw: Hardware, coll: Collectives) -> None:
        self.model, self.par, self.hw, self.coll = model, par, hw, coll
        self.db = DTYPE_BYTES[par.dtype]
        self.seq = model.seq_len // par.cp
        """Tokens of one sequence on this rank (context parallelism splits the sequence)."""
        self.tokens = par.micro_batch * self.seq
        self.tp_group = Group(par.tp, par.tp)

    def site(self, name, phase, pattern, collective, m, k, n, nbytes=None) -> SiteChoice:
        nbytes = self.tokens * self.model.hidden * self.db if nbytes is None else nbytes
        return plan_site(Site(name, phase, pattern, collective, nbytes, m, k, n), self.hw, self.coll,
                         self.tp_group, self.par.overlap.tp, self.par.tp_transport, self.par.dtype)

    def gemm(self, m, k, n) -> float:
        return self.hw.gemm_ms(m, k, n, self.par.dtype)


def gemm_blocks(ctx: Ctx, g: Gemm, fwd, bwd) -> None:
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


def attention_ms(ctx: Ctx) -> tuple[float, float]:
    """(forward, backward) of this rank's attention: flash or unfused, 1/cp of the causal work."""
    model, par, hw = ctx.model, ctx.par, ctx.hw
    heads, s, d = model.num_heads // par.tp, model.seq_len, model.head_dim
    if par.attention in ("flash", "flash2"):
        f, b = hw.attention_ms(par.micro_batch, heads, s, d, par.dtype)
        slow = hw.flash2_slowdown if par.attention == "flash2" else 1.0
        return f * slow / par.cp, b * slow / par.cp
    # Unfused: QK^T and PV as batched GEMMs over the whole s x s (no causal skipping), and the
    # softmax/dropout passes over the scores; backward runs two GEMMs per forward GEMM.
    batch = par.micro_batch * heads
    gemms = batch * (ctx.gemm(s, d, s) + ctx.gemm(s, s, d))
    scores = batch * s * s
    passes = [hw.memory.elementwise_ms(scores, ctx.db, 1) * p for p in UNFUSED_SCORE_PASSES]
    return (gemms + passes[0]) / par.cp, (2 * gemms + passes[1]) / par.cp


def kv_ring(ctx: Ctx, fwd, bwd, att_f: float, att_b: float) -> None:
    """Context parallelism: K/V blocks (and in backward the fp32 dK/dV parts) between the CP ranks beside
    the attention of the block in hand, priced per schedule (overlap.cp_pass_ms); auto keeps the fastest,
    as the engine measures and keeps one."""
    par, model = ctx.par, ctx.model
    group = Group.strided(par.cp, par.tp, ctx.hw.gpus_per_node)
    kv_heads = max(1, model.num_kv_heads // par.tp)
    block = 2 * ctx.tokens * kv_heads * model.head_dim * ctx.db  # K and V of one rank's tokens
    kv = ctx.coll.time_ms("send_recv", block, group)
    dkv = ctx.coll.time_ms("send_recv", block * 4 // ctx.db, group)  # dK/dV parts accumulate in fp32
    mode = par.overlap.cp
    schedules = CP_SCHEDULES if mode == "auto" else (mode,)
    for blk, att, phase in ((fwd, att_f, "fwd"), (bwd, att_b, "bwd")):
        comm = (par.cp - 1) * kv if phase == "fwd" else (par.cp - 2) * kv + (par.cp - 1) * dkv
        wall = min(cp_pass_ms(s, phase, att / par.cp, kv, dkv, par.cp, ctx.hw.sm_comm_slowdown) for s in schedules)
        blk.add_comm("cp_kv", comm, max(0.0, wall - att))


def elementwise_ms(ctx: Ctx, gemms: list[Gemm]) -> float:
    """Norms, residual adds, the MLP activation and RoPE of one layer's forward."""
    model, par, mem = ctx.model, ctx.par, ctx.hw.memory
    sp_tokens = ctx.tokens // par.tp if par.sp else ctx.tokens
    up = gemms[2]
    t = (2 * mem.norm_ms(sp_tokens * model.hidden, ctx.db)
         + 2 * mem.elementwise_ms(sp_tokens * model.hidden, ctx.db)
         + mem.elementwise_ms(up.m * up.n // (2 if model.gated_mlp else 1), ctx.db, 3 if model.gated_mlp else 2)
         + mem.elementwise_ms(ctx.tokens * gemms[0].n, ctx.db, 2))
    return t * (EAGER_PASSES if par.eager else 1.0)


def layer(ctx: Ctx, Block):
    """(forward, backward with its recomputation) of one layer for one micro-batch."""
    model, par = ctx.model, ctx.par
    fwd, bwd = Block(), Block()
    gemms = layer_gemms(model, par, ctx.seq)
    for g in gemms:
        gemm_blocks(ctx, g, fwd, bwd)
    att_f, att_b = attention_ms(ctx)
    fwd.add_compute(f"attention fwd ({par.attention})", att_f)
    bwd.add_compute(f"attention bwd ({par.attention})", att_b)
    if par.cp > 1:
        kv_ring(ctx, fwd, bwd, att_f, att_b)
    elementwise = elementwise_ms(ctx, gemms)
    fwd.add_compute("norms, residuals, activation, rope", elementwise)
    bwd.add_compute("norms, residuals, activation, rope (backward)", 2 * elementwise)
    if model.num_experts > 1 and par.ep > 1:
        expert_all_to_all(ctx, fwd, bwd, gemms)
    recompute = Block()  # runs at the start of the layer's backward
    if par.recompute == "selective":
        recompute.add_compute("recompute attention", att_f)
    elif par.recompute == "op":  # torchtitan's per-op policy: every other matmul, and the cheap ops
        matmuls = sum(r["gemm_ms"] for r in fwd.rows if r.get("m"))
        recompute.add_compute("recompute every other matmul", matmuls / 2)
        recompute.add_compute("recompute norms, activation, rope", elementwise)
    elif par.recompute == "full":
        recompute = Block(fwd.compute_ms, fwd.wall_ms, dict(fwd.comm), dict(fwd.exposed),
                          [dict(r, op="recompute " + r["op"]) for r in fwd.rows])
    return fwd, recompute + bwd


def expert_all_to_all(ctx: Ctx, fwd, bwd, gemms: list[Gemm]) -> None:
    """MoE dispatch and combine around the expert GEMMs, in `moe_chunks` chunks when EP overlap is on."""
    par, model = ctx.par, ctx.model
    group = Group.strided(par.ep, par.tp * par.cp, ctx.hw.gpus_per_node)
    tokens = ctx.tokens // par.tp if par.sp else ctx.tokens
    nbytes = tokens * model.top_k * model.hidden * ctx.db
    a2a = ctx.coll.time_ms("all_to_all", nbytes, group)
    expert_fwd = sum(ctx.gemm(g.m, g.k, g.n) for g in gemms[2:])
    chunked = par.overlap.ep in ("pipelined", "auto")
    c = par.moe_chunks if chunked else 1
    # Each chunk is its own all-to-all: its latency is paid c times, its bytes once in all.
    piece = ctx.coll.time_ms("all_to_all", max(1, nbytes // c), group) if chunked else a2a
    comm = 2 * c * piece
    for block, expert_ms in ((fwd, expert_fwd), (bwd, 2 * expert_fwd)):  # backward: dgrad + wgrad
        if chunked:
            chunk = [ctx.gemm(max(1, g.m // c), g.k, g.n) for g in gemms[2:]]
            compute = c * sum(chunk) * (expert_ms / expert_fwd)
            wall = layered_ms([piece] * c, [compute / c] * c, [piece] * c, ctx.hw.sm_comm_slowdown, prefetch=c)
            exposed = max(0.0, wall - expert_ms)  # chunking losses count as exposed, as in TP
        else:
            exposed = comm
        block.add_comm("ep_all_to_all", comm, exposed)
        block.rows.append({"op": "MoE dispatch + combine (exposed part)", "comm": "ep_all_to_all", "pattern": "exposed",
                           "comm_ms": comm, "gemm_ms": 0.0, "time_ms": exposed, "exposed_ms": exposed,
                           "mode": "pipelined" if chunked else "none", "chunks": c, "group_size": par.ep,
                           "nbytes": nbytes, "note": "", "contention": ctx.hw.sm_comm_slowdown})


def lm_head(ctx: Ctx, Block):
    """(forward, backward) of the LM head GEMM and the fp32 cross-entropy on the last stage."""
    model, par = ctx.model, ctx.par
    fwd, bwd = Block(), Block()
    gemm_blocks(ctx, Gemm("lm_head", ctx.tokens, model.hidden, model.vocab_size // par.tp, True), fwd, bwd)
    logits = ctx.tokens * model.vocab_size // par.tp
    mem = ctx.hw.memory
    fwd.add_compute("cross-entropy (fp32)", logits * CE_BYTES[0] / (mem.elementwise_gbps * 1e6))
    bwd.add_compute("cross-entropy (backward)", logits * CE_BYTES[1] / (mem.elementwise_gbps * 1e6))
    return fwd, bwd


def embedding_backward_ms(ctx: Ctx) -> float:
    """The input embedding's gradient on the first stage, one micro-batch (dense table, fp32 accumulate)."""
    elements = ctx.model.vocab_size * ctx.model.hidden / ctx.par.tp
    return elements * EMBEDDING_GRAD_BYTES / (ctx.hw.memory.elementwise_gbps * 1e6)


def grad_accumulation_ms(ctx: Ctx, params: float) -> float:
    """One micro-batch's share of accumulating `params` weight gradients outside the GEMM.

    hook: read the fresh gradient (activation dtype), read and write the buffer (reduction dtype),
    every micro-batch; autograd: param.grad read and written plus the new gradient read, on every
    micro-batch but the first (spread evenly); kept: the same on every micro-batch. ZeRO-3
    reduce-scatters each micro-batch's gradient instead, and fused accumulates in the wgrad GEMM's
    epilogue: no pass. Gradients of fp32 parameters under autocast are fp32."""
    par, m = ctx.par, ctx.par.micro_batches
    if par.grad_accumulation == "fused" or par.zero == 3 or (par.grad_accumulation == "autograd" and m == 1):
        return 0.0
    gb = 4 if par.weights == "autocast" else ctx.db
    if par.grad_accumulation == "hook":
        nbytes = gb + 2 * par.grad_bytes
    else:
        nbytes = 3 * gb * ((m - 1) / m if par.grad_accumulation == "autograd" else 1.0)
    return params * nbytes / (ctx.hw.memory.elementwise_gbps * 1e6)


def weight_cast_ms(ctx: Ctx, params: float) -> tuple[float, float]:
    """(forward, backward) of one micro-batch's autocast casts of `params` GEMM weights: each fp32 weight
    read and written in the compute dtype before its GEMM, each gradient read and written back in fp32
    after its wgrad; (0, 0) for weights held in the compute dtype."""
    if ctx.par.weights != "autocast":
        return 0.0, 0.0
    ms = params * (4 + ctx.db) / (ctx.hw.memory.elementwise_gbps * 1e6)
    return ms, ms
