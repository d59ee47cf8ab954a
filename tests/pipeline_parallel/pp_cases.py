"""Shared bodies of the pipeline tests: one case builds the GPT, cuts it, runs the engine and
returns the worst relative error of the loss and of every gradient against one process."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist

from overlapkit.data_parallel import DataParallel
from overlapkit.runtime.groups import ParallelGroups
from overlapkit.models import GPT, GPTConfig, expected_local, lm_loss, parallelize
from overlapkit.pipeline_parallel import PipelineConfig, PipelineEngine, placement
from overlapkit.models import gpt_chunks
from overlapkit.tensor_parallel.layers import allreduce_sequence_parallel_grads


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = _local(a).detach().float(), _local(b).detach().float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def tiny_gpt(tp: int, layers: int, seed: int = 0) -> GPT:
    cfg = GPTConfig(vocab_size=8 * tp, seq_len=4 * tp, hidden=8 * tp, num_heads=2 * tp, ffn_hidden=8 * tp,
                    num_layers=layers)
    torch.manual_seed(seed)
    return GPT(cfg)


def data(cfg: GPTConfig, dp: int, m: int, mb: int = 1, seed: int = 1):
    """Per data-parallel replica: (m micro-batches of token ids, m of targets)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (dp, m * mb, cfg.seq_len), generator=g)
    tgt = torch.randint(0, cfg.vocab_size, (dp, m * mb, cfg.seq_len), generator=g)
    return idx, tgt


def reference_grads(ref: GPT, idx, tgt, m: int) -> torch.Tensor:
    """Mean over every replica's micro-batches of the loss, backward on one process; returns the loss."""
    dp = idx.shape[0]
    total = torch.zeros(())
    for d in range(dp):
        for x, y in zip(idx[d].chunk(m), tgt[d].chunk(m)):
            loss = lm_loss(ref(x), y) / (m * dp)
            loss.backward()
            total += loss.detach()
    return total


def loss_fn(logits, target):
    return lm_loss(logits, target)


@dataclass(frozen=True)
class Layout:
    """What a case reads of a ParallelGroups: groups and sizes of pp, dp, tp (dp/tp of size 1: None)."""

    pp: object
    dp: object = None
    tp: object = None

    def size(self, dim):
        g = getattr(self, dim)
        return dist.get_world_size(g) if g is not None else 1

    def rank(self, dim):
        g = getattr(self, dim)
        return dist.get_rank(g) if g is not None else 0


def layout_of(groups: ParallelGroups, dp: bool = True, tp: bool = True) -> Layout:
    return Layout(pp=groups.pp, dp=groups.dp if dp and groups.sizes.dp > 1 else None,
                  tp=groups.tp if tp and groups.sizes.tp > 1 else None)


def pipeline_case(groups: Layout, schedule: str, v: int, m: int, overlap: bool, layers: int,
                  steps: int = 1, sequence_parallel: bool = True, tp_overlap: str = "none",
                  split_backward: bool = False) -> float:
    """Worst relative error (loss and every gradient, every step) of a pp x dp x tp pipeline vs one process."""
    tp, dp, pp = groups.size("tp"), groups.size("dp"), groups.size("pp")
    ref = tiny_gpt(tp, layers)
    model = copy.deepcopy(ref)
    if tp > 1:
        model = parallelize(model, groups.tp, sequence_parallel=sequence_parallel, overlap=tp_overlap)
    chunks, layout = gpt_chunks(model, pp, groups.rank("pp"), v, style=placement(schedule))
    if dp > 1:
        chunks = [DataParallel(c, groups.dp, sequence_parallel_group=groups.tp if tp > 1 else None)
                  for c in chunks]
    engine = PipelineEngine(chunks, groups.pp, PipelineConfig(schedule=schedule, microbatches=m, virtual_stages=v,
                                                              overlap_p2p=overlap, broadcast_loss=True,
                                                              split_backward=split_backward), loss_fn)
    worst = 0.0
    for step in range(steps):
        idx, tgt = data(ref.cfg, dp, m, seed=step + 1)
        for p in ref.parameters():
            p.grad = None
        for c in chunks:
            c.zero_grad() if isinstance(c, DataParallel) else c.zero_grad(set_to_none=True)
        ref_loss = reference_grads(ref, idx, tgt, m)
        d = groups.rank("dp")
        loss = engine.step(idx[d], tgt[d])
        if tp > 1 and dp == 1:
            for c in chunks:
                allreduce_sequence_parallel_grads(c, groups.tp)
        if dp > 1:
            loss = loss.clone()
            dist.all_reduce(loss, group=groups.dp)
            loss /= dp
        worst = max(worst, rel(loss, ref_loss))
        for c in chunks:
            for name, local, full in expected_local(c, ref, "grad"):
                assert local is not None, f"{name} got no gradient"
                worst = max(worst, rel(local, full))
    return worst


def sharded_case(groups: Layout, schedule: str, v: int, m: int, layers: int, steps: int = 3) -> float:
    """pp x dp with a ShardedOptimizer per chunk: the loss of every step (whose forwards run while the
    previous step's parameter gathers land) and the parameters after every step equal one process's SGD."""
    from overlapkit.data_parallel import ShardedOptimizer

    dp, pp = groups.size("dp"), groups.size("pp")
    ref = tiny_gpt(1, layers)
    chunks, _ = gpt_chunks(copy.deepcopy(ref), pp, groups.rank("pp"), v, style=placement(schedule))
    chunks = [DataParallel(c, groups.dp) for c in chunks]
    opts = [ShardedOptimizer(c, torch.optim.SGD, groups.dp, lr=0.5) for c in chunks]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    engine = PipelineEngine(chunks, groups.pp, PipelineConfig(schedule, m, v, broadcast_loss=True), loss_fn)
    worst = 0.0
    for step in range(steps):
        idx, tgt = data(ref.cfg, dp, m, seed=step + 1)
        ref_opt.zero_grad()
        for o in opts:
            o.zero_grad()
        ref_loss = reference_grads(ref, idx, tgt, m)
        loss = engine.step(idx[groups.rank("dp")], tgt[groups.rank("dp")]).clone()
        dist.all_reduce(loss, group=groups.dp)
        worst = max(worst, rel(loss / dp, ref_loss))
        ref_opt.step()
        for o in opts:
            o.step()
    for c, o in zip(chunks, opts):
        o.finish_param_gather()
        for name, local, full in expected_local(c, ref, "data"):
            worst = max(worst, rel(local, full))
    return worst
