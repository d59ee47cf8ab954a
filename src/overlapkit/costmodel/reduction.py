"""The data-parallel part of a step: gradient reductions hidden behind backward, ZeRO's gathers.

Each pipeline stage reduces its gradients in buckets as its last backward produces them (chunk by
chunk when interleaved, inside the pipeline drain when `dp_in_drain`); ZeRO-1/2 reduce-scatter and
gather the parameters back behind the next forward; ZeRO-3 gathers every unit in forward and
backward and reduce-scatters its gradients, `zero3_prefetch` units ahead. A mixture of experts'
expert weights reduce over their own expert-data-parallel group (dp·cp/ep ranks).
"""

from __future__ import annotations

import math

from .block import Block
from .collectives import Group
from .hardware import Hardware
from .layer import Ctx
from .overlap import bucket_sizes, buckets_ms, layered_ms
from .params import RankParams, shards
from .parallel import ParallelConfig

MIB = 2**20


def dp_group(par: ParallelConfig, hw: Hardware) -> Group:
    """The gradient-reduction group: data-parallel and context-parallel ranks, tp apart."""
    return Group.strided(par.dp * par.cp, par.tp, hw.gpus_per_node)


def expert_dp_group(par: ParallelConfig, hw: Hardware) -> Group:
    """The expert gradients' reduction group: the dp·cp/ep ranks holding the same experts, tp·ep apart
    (the EP ranks are adjacent inside the data-parallel dimension, as in layer.expert_all_to_all)."""
    return Group.strided(shards(par)[1], par.tp * par.cp * par.ep, hw.gpus_per_node)


def grad_reduction(par: ParallelConfig) -> tuple[str, str]:
    """(timeline kind, collective) of the gradient reduction: all-reduce, or reduce-scatter under ZeRO."""
    return ("dp_all_reduce", "all_reduce") if par.zero == 0 else ("dp_reduce_scatter", "reduce_scatter")


def _reduction_exposed(ctx: Ctx, grad_bytes: float, hide_ms: float, notes: list | None,
                       expert_share: float = 0.0) -> tuple[float, float]:
    """(comm, exposed) of one stage's bucketed gradient reduction behind `hide_ms` of backward; the
    `expert_share` of the bytes (expert weights) reduces over the expert-data-parallel group instead."""
    par, coll, group, experts = ctx.par, ctx.coll, dp_group(ctx.par, ctx.hw), expert_dp_group(ctx.par, ctx.hw)
    _, name = grad_reduction(par)
    sizes = bucket_sizes(grad_bytes, par.bucket_mib * MIB)

    def price(b: float) -> float:
        return coll.time_ms(name, b * (1 - expert_share), group) + coll.time_ms(name, b * expert_share, experts)

    total = sum(map(price, sizes))
    if par.overlap.dp == "none":
        return total, total
    exposed = buckets_ms(sizes, hide_ms, price, ctx.hw.sm_comm_slowdown) - hide_ms
    if notes is not None and total > hide_ms:
        notes.append(f"dp: gradient {name.replace('_', '-')} ({total:.1f} ms) outlasts the backward that "
                     f"hides it ({hide_ms:.1f} ms): overlap cannot hide more; accumulate more "
                     f"micro-batches per step or shrink the gradients")
    return total, exposed


def _chunked_reduction_exposed(ctx: Ctx, grad_bytes: float, stage_bwd_ms: float,
                               expert_share: float = 0.0) -> tuple[float, float]:
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
        comm, exposed = _reduction_exposed(ctx, grad_bytes / par.vpp, chunk_bwd, None, expert_share)
        comm_total += comm
        stream_free = max(start + chunk_bwd + exposed, stream_free + comm)
    return comm_total, max(0.0, stream_free)


def data_parallel(ctx: Ctx, step: Block, params: list[RankParams], stages: list, slowest: int, layer_f: Block,
                   layer_b: Block, per_stage: int, notes: list) -> dict:
    """Gradient reduction, ZeRO gathers: bucketed behind backward, prefetched before forward."""
    par, hw, coll = ctx.par, ctx.hw, ctx.coll
    group = dp_group(par, hw)
    if par.zero == 3:
        return _zero3(ctx, step, group, layer_f, layer_b, per_stage, notes)
    kind, _ = grad_reduction(par)
    # Each stage reduces behind its own last backward. Inside the drain, stage i finishes that
    # backward before stage 0 does by the last backwards of stages i-1 .. 0, and its reduction may use them.
    candidates = {0, slowest, par.pp - 1} if par.dp_in_drain else {slowest}
    worst, total = 0.0, 0.0
    for i in sorted(candidates):
        bwd, share = stages[i][1].wall_ms, params[i].expert / params[i].total
        if par.vpp > 1 and par.overlap.dp != "none":
            comm, exposed = _chunked_reduction_exposed(ctx, params[i].total * par.grad_bytes, bwd, share)
        else:
            comm, exposed = _reduction_exposed(ctx, params[i].total * par.grad_bytes, bwd,
                                               notes if i == slowest else None, share)
        if i == slowest:
            total = comm
        slack = sum(stages[j][1].wall_ms for j in range(i)) if par.dp_in_drain else 0.0
        worst = max(worst, exposed - slack)
    step.add_comm(kind, total, max(0.0, worst))
    if par.zero in (1, 2):  # parameters gathered after the sharded step, before the next forward
        gathers = [_layer_collective_ms(ctx, "all_gather", 1, ctx.db)] * per_stage
        t = sum(gathers)
        if par.overlap.zero == "none":
            exp = t
        else:
            exp = layered_ms(gathers, [layer_f.wall_ms] * per_stage, [0.0] * per_stage, hw.sm_comm_slowdown) \
                - per_stage * layer_f.wall_ms
        step.add_comm("zero_all_gather", t, max(0.0, exp))
    return {}


def _layer_collective_ms(ctx: Ctx, kind: str, layers: int, bytes_per_param: float) -> float:
    """A ZeRO gather or reduce-scatter of `layers` layers' parameters on one rank: the dense shard over
    the dp group, the expert shard over the expert-data-parallel group."""
    model, par = ctx.model, ctx.par
    dense = model.dense_layer_params / par.tp * layers * bytes_per_param
    expert = model.expert_layer_params / (par.tp * par.ep) * layers * bytes_per_param
    return (ctx.coll.time_ms(kind, dense, dp_group(par, ctx.hw))
            + ctx.coll.time_ms(kind, expert, expert_dp_group(par, ctx.hw)))


def _zero3(ctx: Ctx, step: Block, group: Group, layer_f: Block, layer_b: Block, per_stage: int, notes: list) -> dict:
    """ZeRO-3 / FSDP: per unit of `zero3_wrap` layers, gathered in forward and backward, gradients
    reduce-scattered in backward, gathers issued `zero3_prefetch` units ahead (or chosen)."""
    from .fsdp import fsdp_prefetch_choice, prefetch_wall_ms
    from .memory import estimate

    par, coll, slow = ctx.par, ctx.coll, ctx.hw.sm_comm_slowdown
    wrap = min(par.zero3_wrap, per_stage)
    units = max(1, per_stage // wrap)
    unit_params = (ctx.model.dense_layer_params + ctx.model.expert_layer_params / par.ep) / par.tp * wrap
    ag = _layer_collective_ms(ctx, "all_gather", wrap, ctx.db)
    rs = _layer_collective_ms(ctx, "reduce_scatter", wrap, par.grad_bytes)
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
