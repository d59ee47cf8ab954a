"""Bodies of the split-backward tests: what the recorded spans show (W after its B, the weight-gradient
GEMMs inside W, the data-parallel buckets inside the drain, a DualPipeV pair's all-to-alls under the
other side's expert GEMMs) and what the deferred GEMMs keep, next to one process's numbers."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from overlapkit.data_parallel import DataParallel
from overlapkit.pipeline_parallel import (PipelineConfig, PipelineEngine, placement, price,
                                          sequential_chunks, timetable)
from overlapkit.models import gpt_chunks
from overlapkit.timeline import record
from pp_cases import data, loss_fn, reference_grads, rel, tiny_gpt

WIDTHS = [6] * 9
"""Equal widths: every chunk's W inputs weigh the same, so the peak is a count times one micro-batch's."""


def _spans(rec, step: int = 0) -> list[tuple]:
    return [(s.kind, s.name, s.start_ms, s.end_ms) for s in rec.spans if s.step == step]


def linears_case(group, schedule: str, m: int, rows: int = 3, split_backward: bool = False) -> dict:
    """An nn.Sequential of Linear + Tanh cut for `schedule`: one recorded step; its spans, the bytes
    the deferred GEMMs kept at their peak and what one micro-batch's W inputs weigh, and the error."""
    pp, rank = dist.get_world_size(group), dist.get_rank(group)
    v = 2 if placement(schedule) == "v" else 1
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in zip(WIDTHS, WIDTHS[1:])][:2 * pp * v]
    ref = nn.Sequential(*layers)
    chunks, _ = sequential_chunks(copy.deepcopy(ref), pp, rank, v, style=placement(schedule))
    width = WIDTHS[len(layers)]
    x, y = torch.randn(m * rows, WIDTHS[0]), torch.randn(m * rows, width)
    mse = lambda out, t: ((out - t) ** 2).mean()  # noqa: E731
    engine = PipelineEngine(chunks, group, PipelineConfig(schedule, m, v, broadcast_loss=True,
                                                          split_backward=split_backward), mse)
    with record() as rec:
        loss = engine.step(x, y)
    ref_loss = sum(mse(ref(a), b) / m for a, b in zip(x.chunk(m), y.chunk(m)))
    ref_loss.backward()
    refs = dict(ref.named_parameters())
    err = max([rel(loss, ref_loss)] + [rel(p.grad, refs[n].grad) for c in chunks for n, p in c.named_parameters()])
    per_mb = sum(rows * (lin.in_features + lin.out_features) * 4 for c in chunks for lin in c.modules()
                 if isinstance(lin, nn.Linear))
    cost = price(timetable(schedule, pp, v, m, split_backward=split_backward), 1.0, 1.0, 1.0)
    return dict(err=err, spans=_spans(rec), kept_peak=engine.last_kept_w_peak_bytes,
                kept_mb=per_mb / v, predicted_kept=cost.peak_kept_w[rank])


def dp_drain_case(groups, schedule: str, m: int) -> dict:
    """pp=2 x dp=2, small buckets: the reduction of each chunk launches inside that chunk's last W."""
    pp, rank = groups.sizes.pp, groups.pp_rank
    v = 2 if placement(schedule) == "v" else 1
    ref = tiny_gpt(1, 2 * v)
    chunks, _ = gpt_chunks(copy.deepcopy(ref), pp, rank, v, style=placement(schedule))
    chunks = [DataParallel(c, groups.dp, bucket_mb=0.0005, first_bucket_mb=0.0005) for c in chunks]
    engine = PipelineEngine(chunks, groups.pp, PipelineConfig(schedule, m, v, broadcast_loss=True), loss_fn)
    idx, tgt = data(ref.cfg, 2, m)
    ref_loss = reference_grads(ref, idx, tgt, m)
    with record() as rec:
        loss = engine.step(idx[groups.dp_rank], tgt[groups.dp_rank]).clone()
    dist.all_reduce(loss, group=groups.dp)
    from overlapkit.models import expected_local
    err = max([rel(loss / 2, ref_loss)] + [rel(local, full) for c in chunks for _, local, full in
                                           expected_local(c, ref, "grad")])
    mine = [c.module.pipeline_chunk for c in chunks]
    return dict(err=err, spans=_spans(rec), chunks=mine, buckets=[len(c.sync.buffer.buckets) for c in chunks])


def moe_pair_case(groups, m: int = 4, chunks_per_moe: int = 1) -> dict:
    """DualPipeV over pp=2, every block a MoE whose experts are split over ep=2 (the stage's dp ranks):
    loss and gradients against one process, and the recorded spans of a step."""
    from overlapkit.expert_parallel import MoE, average_data_parallel_grads
    from overlapkit.models.moe_gpt import expected_local_ep, solo_group
    from overlapkit.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=16, seq_len=8, hidden=8, num_heads=2, ffn_hidden=16, num_layers=4)
    solo = solo_group()

    def build(group):
        torch.manual_seed(0)
        return GPT(cfg, moe_every=1, moe=lambda i: MoE(cfg.hidden, cfg.ffn_hidden, 4, 2, group, chunks=chunks_per_moe,
                                                      name=f"blocks.{i}.moe"))
    ref, model = build(solo), build(groups)
    chunks, _ = gpt_chunks(model, 2, groups.pp_rank, 2, style="v")
    engine = PipelineEngine(chunks, groups.pp, PipelineConfig("dualpipev", m, 2, broadcast_loss=True), loss_fn)
    idx, tgt = data(cfg, 2, m, mb=2)
    ref_loss = reference_grads(ref, idx, tgt, m)
    d = groups.dp_rank
    engine.step(idx[d], tgt[d])  # warm: the first step learns shapes and agrees the MoE inputs
    for c in chunks:
        c.zero_grad(set_to_none=True)
    with record() as rec:
        loss = engine.step(idx[d], tgt[d]).clone()
    for c in chunks:
        average_data_parallel_grads(c, groups.dp, groups.ep)
    dist.all_reduce(loss, group=groups.dp)
    err = max([rel(loss / 2, ref_loss)] + [rel(local, full) for c in chunks
                                           for _, local, full in expected_local_ep(c, ref, "grad")])
    pairs = [(a[3], a[4]) for a in engine.timings[0].actions if a[0] == "F"]
    return dict(err=err, spans=_spans(rec), pairs=sorted(set(pairs)), timing=engine.timings[0])


def tp_deferral_case(groups, schedule: str, m: int = 4) -> dict:
    """pp=2 x tp=2 (sequence parallel, bulk): the names of the TP layers' weight-gradient GEMM spans of a
    recorded step, and the error against one process. Split, those GEMMs run in W (under W's own span)."""
    from overlapkit.models import expected_local, parallelize
    from overlapkit.tensor_parallel.layers import allreduce_sequence_parallel_grads

    v = 2 if placement(schedule) == "v" else 1
    ref = tiny_gpt(2, 2 * v)
    model = parallelize(copy.deepcopy(ref), groups.tp, sequence_parallel=True, overlap="bulk")
    chunks, _ = gpt_chunks(model, 2, groups.pp_rank, v, style=placement(schedule))
    engine = PipelineEngine(chunks, groups.pp, PipelineConfig(schedule, m, v, broadcast_loss=True), loss_fn)
    idx, tgt = data(ref.cfg, 1, m)
    ref_loss = reference_grads(ref, idx, tgt, m)
    with record() as rec:
        loss = engine.step(idx[0], tgt[0])
    for c in chunks:
        allreduce_sequence_parallel_grads(c, groups.tp)
    err = max([rel(loss, ref_loss)] + [rel(local, full) for c in chunks for _, local, full in
                                       expected_local(c, ref, "grad")])
    return dict(err=err, wgrad=sorted({s.name for s in rec.spans if ".bwd.wgrad" in s.name}),
                w_spans=sum(s.name.startswith("pp.W") and s.name.endswith(".wgrad") for s in rec.spans))
