"""Overlap is measured, not assumed: the recorder shows the gradient reduction finishing while
backward still computes, and the parameter gather landing while forward already computes.

Both facts are made robust under load by an artificially slow step (a sleep of several
hundred ms) between the communication and the end of the computation it hides behind; the
sequential settings serve as the control, where the same assertion must fail.
"""

import functools
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from distributed import distributed
from overlapkit.data_parallel import DataParallel, ShardedOptimizer
from overlapkit.timeline import record
from overlapkit.runtime.recorder import compute_span

SLOW_S = 0.6


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        with compute_span("slow backward"):
            time.sleep(SLOW_S)
        return g


class SlowBackward(nn.Module):
    def forward(self, x):
        return _SleepInBackward.apply(x)


class SlowForward(nn.Module):
    def forward(self, x):
        with compute_span("slow forward"):
            time.sleep(SLOW_S)
        return x


def _net(slow: nn.Module, at: int) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)]
    return nn.Sequential(*layers[:at], slow, *layers[at:])


def _first(spans, kind, name):
    return next(s for s in spans if s.kind == kind and s.name == name)


def _grad_reduce_timeline(overlap: bool):
    group = dist.group.WORLD
    # Backward runs right to left: the last Linear's bucket is full before the slow op starts.
    m = DataParallel(_net(SlowBackward(), at=1), group, first_bucket_mb=1e-9, bucket_mb=1e-9, overlap=overlap)
    x = torch.randn(8, 16)
    dist.barrier()
    with record() as rec:
        F.mse_loss(m(x), torch.zeros(8, 4)).backward()
    bucket0 = _first(rec.spans, "dp_all_reduce", "bucket0")
    slow = _first(rec.spans, "compute", "slow backward")
    backward = _first(rec.spans, "compute", "backward")
    return dict(bucket0_params=m.sync.buffer.buckets[0].names, bucket0_end=bucket0.end_ms,
                bucket0_start=bucket0.start_ms, slow_end=slow.end_ms, backward_end=backward.end_ms)


@distributed(world_size=2, timeout_s=60.0)
def _run_all():
    return {(kind, on): case(on) for kind, case in (("reduce", _grad_reduce_timeline), ("gather", _param_gather_timeline))
            for on in (True, False)}


@functools.cache
def _timelines(kind: str, on: bool) -> list[dict]:
    return [per_rank[(kind, on)] for per_rank in _all()]


@functools.cache
def _all():
    return _run_all()


def test_first_bucket_reduced_while_backward_computes():
    for r in _timelines("reduce", True):
        assert r["bucket0_params"] == ["3.bias"], r  # the last layer's last parameter: ready first
        assert r["bucket0_end"] < r["slow_end"] < r["backward_end"], r


def test_without_overlap_reduction_waits_for_backward():
    for r in _timelines("reduce", False):
        assert r["bucket0_start"] >= r["backward_end"], r
        assert not r["bucket0_end"] < r["slow_end"], r


def _param_gather_timeline(overlap_param_gather: bool):
    group = dist.group.WORLD
    rank = dist.get_rank()
    # The slow op comes first: the whole forward of the Linears is still ahead while gathers land.
    m = DataParallel(_net(SlowForward(), at=0), group, first_bucket_mb=1e-9, bucket_mb=1e-9)
    opt = ShardedOptimizer(m, torch.optim.AdamW, group, overlap_param_gather=overlap_param_gather, lr=1e-2)
    x = torch.randn(8, 16)
    F.mse_loss(m(x), torch.zeros(8, 4)).backward()
    dist.barrier()
    if rank == 1:
        time.sleep(SLOW_S / 2)  # rank 1 joins the gathers late: on rank 0 they are in flight for a while
    with record() as rec:
        opt.step()
        y = m(x)
    gathers = [s for s in rec.spans if s.kind == "zero_all_gather"]
    forward = _first(rec.spans, "compute", "forward")
    slow = _first(rec.spans, "compute", "slow forward")
    return dict(gathers=len(gathers), n_buckets=len(m.sync.buffer.buckets), forward_start=forward.start_ms,
                gathers_end=max(s.end_ms for s in gathers), slow_end=slow.end_ms, out=y.sum().item())


def test_param_gather_lands_while_forward_computes():
    r = _timelines("gather", True)[0]  # rank 0, whose peer is late
    assert r["gathers"] == r["n_buckets"], r
    assert r["forward_start"] < r["gathers_end"] < r["slow_end"], r


def test_without_overlap_step_waits_for_gathers():
    r = _timelines("gather", False)[0]
    assert r["gathers_end"] <= r["forward_start"], r
