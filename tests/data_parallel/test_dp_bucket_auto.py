"""`bucket_mb="auto"`: the gradients stay exact while candidate groupings are timed and after one is kept;
the kept one is what the collectives send, nothing of the trials runs after it, ranks that ask for
different bucket sizes fail on every rank, and the reduction still overlaps backward.

The candidate caps are scaled down (bytes instead of MiB) so that a tiny model has several fine
buckets and every candidate groups them differently.
"""

from __future__ import annotations

import copy
import functools
import inspect
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from distributed import distributed
from dp_cases import rel_err
from overlapkit.data_parallel import DataParallel, DataParallelConfig, ShardedOptimizer, bucket_auto
from overlapkit.runtime import tuning
from overlapkit.runtime.recorder import compute_span
from overlapkit.timeline import record

TOL = 1e-5
B = 1 / 2**20  # one byte, in MiB
SMALL_CAPS = (1024 * B, 512 * B, 4096 * B, 256 * B)
STEPS = 24  # 4 candidates x (1 warm-up + 4 rounds) = 20 trial steps; the 21st forward decides


def small_caps() -> None:
    """Fine buckets of 256 B, candidates 1 KiB / 512 B / 4 KiB / 256 B (in this order of preference)."""
    bucket_auto.FINE_MB = 256 * B
    bucket_auto.AUTO_CAPS_MB = SMALL_CAPS


class Deep(nn.Module):
    """Nine small layers (~2.3 KB of fp32 gradients) and a `spare` layer, never used (frozen unless `spare`)."""

    def __init__(self, spare: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(5, 8)] + [nn.Linear(8, 8) for _ in range(7)] + [nn.Linear(8, 3)])
        self.spare = nn.Linear(8, 8).requires_grad_(spare)

    def forward(self, x, use_spare: bool = False):
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return self.layers[-1](self.spare(x) if use_spare else x)


def _batch(step: int, world: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(4 * world, 5, generator=g), torch.randn(4 * world, 3, generator=g)


def _used(m: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for n, p in m.named_parameters() if not n.startswith("spare")]


def _bucket_spans(spans) -> list:
    return [s for s in spans if s.kind in ("dp_all_reduce", "dp_reduce_scatter") and s.name.startswith("bucket")]


def _train_compare(rank: int, world: int, group, **kw) -> dict:
    """STEPS steps of auto beside one process on the whole batch and DDP: worst error during / after the trials."""
    spare = kw.get("find_unused", False)
    m = DataParallel(Deep(spare), group, first_bucket_mb=1e-9, **kw)
    ref, ddp = Deep(), nn.parallel.DistributedDataParallel(Deep(), process_group=group)
    runs = dict(m.sync.auto.runs)
    out = {"during": 0.0, "after": 0.0, "ddp": 0.0, "trial counts": set(), "counts match": True,
           "fine": len(m.sync.buffer.fine)}
    for step in range(STEPS):
        x, y = _batch(step, world)
        xs, ys = x[4 * rank:4 * rank + 4], y[4 * rank:4 * rank + 4]
        for model in (m, ref, ddp):
            model.zero_grad()
        trialing = m.bucket_choice.decided is None
        with record() as rec:
            out_m = m(xs)
            buckets_now = len(m.sync.buffer.buckets)
            F.mse_loss(out_m, ys).backward()
        F.mse_loss(ref(x), y).backward()
        F.mse_loss(ddp(xs), ys).backward()
        err = max(rel_err(a, b) for a, b in zip(_used(m.module), _used(ref)))
        out["during" if trialing else "after"] = max(out["during" if trialing else "after"], err)
        out["ddp"] = max(out["ddp"], max(rel_err(a, b) for a, b in zip(_used(m.module), _used(ddp.module))))
        out["counts match"] &= len(_bucket_spans(rec.spans)) == buckets_now
        if trialing and step >= len(runs):  # past the first (warm-up) round: the groupings are timed
            out["trial counts"].add(buckets_now)
    out["candidate counts"] = {len(r) for r in runs.values()}
    out["decided"] = m.bucket_choice.decided
    g = m.module.spare.weight.grad
    out["spare grad"] = None if g is None else g.abs().max().item()
    return out


def _after_deciding(rank: int, world: int, group) -> dict:
    """The collectives after the decision have the kept grouping's sizes; no clock, trial or agreement runs."""
    m = DataParallel(Deep(), group, first_bucket_mb=1e-9)
    runs = dict(m.sync.auto.runs)
    item = m.sync.buffer.data.element_size()
    fine = [b.numel for b in m.sync.buffer.fine]
    for step in range(STEPS - 3):
        x, y = _batch(step, world)
        F.mse_loss(m(x[4 * rank:4 * rank + 4]), y[4 * rank:4 * rank + 4]).backward()
    calls = {"stamp": 0, "trial": 0}
    stamp, trial = tuning._stamp, tuning.MeasuredChoice.trial

    def counted(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapper

    tuning._stamp, tuning.MeasuredChoice.trial = counted("stamp", stamp), counted("trial", trial)
    try:
        with record() as rec:
            for step in range(2):
                x, y = _batch(step, world)
                F.mse_loss(m(x[4 * rank:4 * rank + 4]), y[4 * rank:4 * rank + 4]).backward()
    finally:
        tuning._stamp, tuning.MeasuredChoice.trial = stamp, trial
    sizes, start = [], 0
    for k in runs[m.bucket_choice.decided]:
        sizes.append(sum(fine[start:start + k]) * item)
        start += k
    comm_names = sorted({s.name for s in rec.spans if s.kind.startswith("dp_")})
    return dict(decided=m.bucket_choice.decided, reason=m.bucket_choice.reason, calls=calls,
                sent=[s.nbytes for s in _bucket_spans(rec.spans)], expected=sizes * 2, comm_names=comm_names,
                sync_auto=m.sync.auto, hooks=[len(p._post_accumulate_grad_hooks or {}) for p in m.sync.params],
                measured=m.bucket_choice.measured)


def _sharded(rank: int, world: int, group) -> dict:
    m = DataParallel(Deep(), group, first_bucket_mb=1e-9)
    opt = ShardedOptimizer(m, torch.optim.AdamW, group, lr=1e-2)
    ref = Deep()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        x, y = _batch(step, world)
        opt.zero_grad()
        ref_opt.zero_grad()
        F.mse_loss(m(x[4 * rank:4 * rank + 4]), y[4 * rank:4 * rank + 4]).backward()
        F.mse_loss(ref(x), y).backward()
        opt.step()
        ref_opt.step()
    opt.finish_param_gather()
    err = max(rel_err(a, b) for (n, a), b in zip(m.module.named_parameters(), ref.parameters())
              if not n.startswith("spare"))
    return dict(err=err, decided=m.bucket_choice.decided, reason=m.bucket_choice.reason,
                aligned=all(b.numel % (world * 16) == 0 for b in m.sync.buffer.buckets))


def _disagree(rank: int, group) -> str | None:
    try:
        DataParallel(Deep(), group, bucket_mb="auto" if rank == 0 else 25.0)
        return None
    except ValueError as e:
        return str(e)


def _run(world: int) -> dict:
    small_caps()
    rank, group = dist.get_rank(), dist.group.WORLD
    out = {name: _train_compare(rank, world, group, **kw) for name, kw in {
        "auto": {}, "overlap=False": dict(overlap=False), "bf16 reduce": dict(grad_reduce_dtype=torch.bfloat16),
        "find_unused": dict(find_unused=True)}.items()}
    out["after deciding"] = _after_deciding(rank, world, group)
    out["sharded"] = _sharded(rank, world, group)
    t0 = time.perf_counter()
    out["disagree"] = _disagree(rank, group)
    out["disagree seconds"] = time.perf_counter() - t0
    return out


@distributed(world_size=2, timeout_s=90.0)
def _two():
    return _run(2)


@distributed(world_size=3, timeout_s=90.0)
def _three():
    return _run(3)


@functools.cache
def results(world: int) -> list[dict]:
    return {2: _two, 3: _three}[world]()


WORLDS = [2, 3]


def test_auto_is_the_default():
    assert inspect.signature(DataParallel).parameters["bucket_mb"].default == "auto"
    assert DataParallelConfig().bucket_mb == "auto"
    with pytest.raises(ValueError, match='bucket_mb must be "auto" or a finite number'):
        DataParallelConfig(bucket_mb="fast")


def test_runs_for_cap_keeps_the_first_alone_and_closes_at_the_cap():
    assert bucket_auto.runs_for_cap([10, 10, 10, 10, 10], 20) == (1, 2, 2)
    assert bucket_auto.runs_for_cap([10, 10, 10, 10, 10], 1) == (1, 1, 1, 1, 1)
    assert bucket_auto.runs_for_cap([10, 10, 10, 10, 10], 1e9) == (1, 4)
    assert bucket_auto.runs_for_cap([5, 30, 10, 10], 15) == (1, 1, 2)


def test_world_size_one_keeps_the_first_candidate_unmeasured():
    m = DataParallel(Deep(), None, first_bucket_mb=1e-9)
    assert m.bucket_choice.decided == bucket_auto.AUTO_CAPS_MB[0] and m.sync.auto is None
    assert "world size 1" in m.bucket_choice.reason


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", ["auto", "overlap=False", "find_unused"])
def test_grads_equal_one_process_and_ddp_during_and_after_trials(world, case):
    for r in results(world):
        c = r[case]
        assert c["during"] <= TOL and c["after"] <= TOL and c["ddp"] <= TOL, c
        assert c["counts match"], c  # every step sent the buckets its grouping had
        assert c["trial counts"] == c["candidate counts"] and len(c["candidate counts"]) == 4, c
        assert c["spare grad"] == (0.0 if case == "find_unused" else None), c  # find_unused: zeros reduced


@pytest.mark.parametrize("world", WORLDS)
def test_bf16_reduce_with_auto(world):
    for r in results(world):
        c = r["bf16 reduce"]
        assert c["during"] <= 1e-2 and c["after"] <= 1e-2, c  # bf16 keeps ~3 significant digits


@pytest.mark.parametrize("world", WORLDS)
def test_same_decision_on_every_rank(world):
    out = results(world)
    for case in ("auto", "overlap=False", "after deciding"):
        assert len({r[case]["decided"] for r in out}) == 1, [r[case]["decided"] for r in out]
        assert out[0][case]["decided"] in SMALL_CAPS


@pytest.mark.parametrize("world", WORLDS)
def test_decision_is_applied_and_nothing_of_the_trials_runs_after_it(world):
    for r in results(world):
        a = r["after deciding"]
        assert a["sent"] == a["expected"], a  # the kept grouping's byte counts, bucket by bucket, 2 steps
        assert a["calls"] == {"stamp": 0, "trial": 0}, a
        assert a["comm_names"] == sorted({f"bucket{i}" for i in range(len(a["expected"]) // 2)} | {"unused-check"}), a
        assert a["sync_auto"] is None and a["hooks"] == [1] * len(a["hooks"]), a
        assert a["reason"].startswith("measured forward+backward") and len(a["measured"]) == 4, a


@pytest.mark.parametrize("world", WORLDS)
def test_sharded_optimizer_keeps_the_first_candidate(world):
    for r in results(world):
        s = r["sharded"]
        assert s["err"] <= TOL, s
        assert s["decided"] == 1024 * B and "sharded optimizer" in s["reason"], s
        assert s["aligned"], s  # every collective splits into equal aligned shards


@pytest.mark.parametrize("world", WORLDS)
def test_ranks_passing_different_bucket_mb_fail_on_every_rank(world):
    for r in results(world):
        assert r["disagree"] is not None and "bucket_mb" in r["disagree"], r["disagree"]
        assert r["disagree seconds"] < 30, r


# -- overlap, from the recorder ------------------------------------------------------------

SLOW_S = 0.6


class _Slow(torch.autograd.Function):
    on = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if _Slow.on:
            with compute_span("slow backward"):
                time.sleep(SLOW_S)
        return g


class _SlowNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.c(self.b(_Slow.apply(self.a(x))))


def _first(spans, kind, name):
    return next(s for s in spans if s.kind == kind and s.name == name)


@distributed(world_size=2, timeout_s=90.0)
def _overlap():
    small_caps()
    m = DataParallel(_SlowNet(), dist.group.WORLD, first_bucket_mb=1e-9)
    x = torch.randn(8, 16)
    out = {}
    for step in range(STEPS):
        phase = "trial" if step == 5 else "kept" if step == STEPS - 1 else None
        _Slow.on = phase is not None
        dist.barrier()
        with record() as rec:
            F.mse_loss(m(x), torch.zeros(8, 4)).backward()
        if phase:
            b0 = _first(rec.spans, "dp_all_reduce", "bucket0")
            out[phase] = dict(decided=m.bucket_choice.decided, first=m.sync.buffer.buckets[0].names,
                              b0_end=b0.end_ms, slow_end=_first(rec.spans, "compute", "slow backward").end_ms,
                              bwd_end=_first(rec.spans, "compute", "backward").end_ms)
    return out


def test_auto_reduces_the_first_bucket_while_backward_computes():
    for r in _overlap():
        assert r["trial"]["decided"] is None and r["kept"]["decided"] is not None, r
        for phase in ("trial", "kept"):
            t = r[phase]
            assert t["first"] == ["c.bias"], t  # the last layer's last parameter: ready first
            assert t["b0_end"] < t["slow_end"] < t["bwd_end"], t


# -- with sequence parallelism (tp 2 x dp 2) -----------------------------------------------

@distributed(world_size=4, timeout_s=120.0)
def _sequence_parallel():
    from overlapkit.models import GPT, GPTConfig, expected_local, lm_loss, parallelize
    from overlapkit.runtime.groups import ParallelGroups

    bucket_auto.FINE_MB = 512 * B
    bucket_auto.AUTO_CAPS_MB = (4096 * B, 1024 * B, 512 * B)
    groups = ParallelGroups.build(tp=2, dp=2)
    cfg = GPTConfig(vocab_size=16, seq_len=8, hidden=16, num_heads=2, ffn_hidden=16, num_layers=2)
    torch.manual_seed(5)
    ref = GPT(cfg)
    model = DataParallel(parallelize(copy.deepcopy(ref), groups, sequence_parallel=True, overlap="bulk"),
                         groups.dp, first_bucket_mb=1e-9, sequence_parallel_group=groups.tp)
    candidates = len(model.sync.auto.runs)
    gen = torch.Generator().manual_seed(9)
    rows = slice(2 * groups.dp_rank, 2 * groups.dp_rank + 2)
    worst = {"during": 0.0, "after": 0.0}
    for _ in range(5 * candidates + 3):
        idx, tgt = torch.randint(0, 16, (4, 8), generator=gen), torch.randint(0, 16, (4, 8), generator=gen)
        trialing = model.bucket_choice.decided is None
        model.zero_grad()
        ref.zero_grad()
        lm_loss(model(idx[rows]), tgt[rows]).backward()
        lm_loss(ref(idx), tgt).backward()
        err = max(rel_err(loc, full) for _, loc, full in expected_local(model, ref, "grad"))
        key = "during" if trialing else "after"
        worst[key] = max(worst[key], err)
    return dict(worst, candidates=candidates, decided=model.bucket_choice.decided)


def test_auto_with_sequence_parallel_grads():
    out = _sequence_parallel()
    for r in out:
        assert r["candidates"] >= 2 and r["decided"] is not None, r
        assert r["during"] <= TOL and r["after"] <= TOL, r
    assert len({r["decided"] for r in out}) == 1
