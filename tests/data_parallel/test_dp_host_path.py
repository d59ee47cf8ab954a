"""DataParallel's per-step host path: after an optimizer's zero_grad() (gradients set to None)
backward accumulates straight into the gradient buffer (no per-parameter copy in the hooks),
the gradients are still exactly one process's, and at world size 1 no collective is issued."""

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

from distributed import distributed
from dp_cases import PER_RANK, mlp, rel_err
from overlapkit.data_parallel import DataParallel
from overlapkit.data_parallel.buckets import GradBuffer
from overlapkit.timeline import record

STEPS = 3
TOL = 1e-5


def _batch(world: int, step: int):
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(world * PER_RANK, 5, generator=g), torch.randn(world * PER_RANK, 3, generator=g)


def _body() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    sl = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    out = {}
    for overlap in (True, False):
        ref, dp = mlp(), DataParallel(mlp(), dist.group.WORLD, bucket_mb=1e-9, first_bucket_mb=1e-9, overlap=overlap)
        ref_opt, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(dp.parameters(), lr=0.1)
        copies, real_attach = [0], GradBuffer.attach

        def counted(self, p):
            copies[0] += 1
            return real_attach(self, p)
        errs, in_buffer, kinds = [], [], set()
        for step in range(STEPS):
            x, y = _batch(world, step)
            ref_opt.zero_grad()
            F.mse_loss(ref(x), y).backward()
            ref_opt.step()
            opt.zero_grad()  # set_to_none: every .grad is None going into backward
            GradBuffer.attach = counted
            try:
                with record() as rec:
                    F.mse_loss(dp(x[sl]), y[sl]).backward()
            finally:
                GradBuffer.attach = real_attach
            kinds |= {s.kind for s in rec.spans if not s.is_compute}
            errs.append(max(rel_err(a.grad, b.grad) for a, b in zip(dp.module.parameters(), ref.parameters())))
            lo, hi = dp.sync.buffer.data.data_ptr(), dp.sync.buffer.data.data_ptr() + dp.sync.buffer.data.nbytes
            in_buffer.append(all(lo <= p.grad.data_ptr() < hi for p in dp.module.parameters()))
            opt.step()
        out[f"overlap={overlap}"] = dict(err=max(errs), in_buffer=all(in_buffer), copies=copies[0], kinds=kinds)
    # Some gradients None, the others kept: the kept ones accumulate, as autograd's own do.
    ref, dp = mlp(), DataParallel(mlp(), dist.group.WORLD, bucket_mb=1e-9, first_bucket_mb=1e-9)
    for step in range(2):
        x, y = _batch(world, step)
        for m in (ref, dp.module):
            for i, p in enumerate(m.parameters()):
                if step and i % 2:
                    p.grad = None
        F.mse_loss(ref(x), y).backward()
        F.mse_loss(dp(x[sl]), y[sl]).backward()
    out["partly None"] = max(rel_err(a.grad, b.grad) for a, b in zip(dp.module.parameters(), ref.parameters()))
    return out


@distributed(world_size=1, timeout_s=60.0)
def _one():
    return _body()


@distributed(world_size=2, timeout_s=60.0)
def _two():
    return _body()


@pytest.mark.parametrize("world", [1, 2])
def test_zero_grad_to_none_accumulates_into_the_buffer_exactly(world):
    for r in (_one if world == 1 else _two)():
        for overlap in (True, False):
            case = r[f"overlap={overlap}"]
            assert case["err"] <= TOL, case
            assert case["in_buffer"], case  # .grad are the buffer's views again
            assert case["copies"] == 0, case  # no hook copied a gradient in
            # World size 1: the gradient is its own average, nothing is sent; 2: one all-reduce a bucket, and the flags.
            assert case["kinds"] == (set() if world == 1 else {"dp_all_reduce"}), case
        assert r["partly None"] <= TOL, r
