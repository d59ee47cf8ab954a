"""Models, references and per-rank bodies shared by the data-parallel tests.

Each spawned body runs many cases on one set of ranks (starting ranks is the slow part on a
shared CPU) and returns plain numbers; the test files assert on them. The body of a case is
always: the same model on every rank, each rank its slice of one global batch, compared with
one process that sees the whole batch.
"""

from __future__ import annotations

import functools
import io
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from distributed import distributed
from overlapkit.runtime import comm
from overlapkit.data_parallel import DataParallel, ShardedOptimizer

BUCKETS = {  # (first_bucket_mb, bucket_mb)
    "one param per bucket": (1e-9, 1e-9),
    "a few buckets": (100 / 2**20, 400 / 2**20),
    "one bucket": (1e3, 1e3),
}
PER_RANK = 4  # samples per rank per micro-batch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def mlp(seed: int = 0, dtype=torch.float32) -> nn.Module:
    """Odd sizes: no bucket and no buffer divides evenly by 2, 3 or the shard alignment."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 3)).to(dtype)


class Tied(nn.Module):
    """Embedding and output head share one weight: it must be reduced once."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.mid(self.emb(idx))))


class WithSpare(nn.Module):
    """`spare` is used only when asked: unused everywhere, or on some ranks only."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.spare, self.fc2 = nn.Linear(5, 7), nn.Linear(7, 7), nn.Linear(7, 3)

    def forward(self, x, use_spare: bool):
        h = torch.tanh(self.fc1(x))
        return self.fc2(self.spare(h) if use_spare else h)


def data(world: int, micro: int = 1, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    n = world * micro * PER_RANK
    return torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g)


def local(t: torch.Tensor, rank: int, world: int, micro: int = 0) -> torch.Tensor:
    """Rank's slice of micro-batch `micro` out of a global batch laid out micro-batch by micro-batch."""
    start = (micro * world + rank) * PER_RANK
    return t[start:start + PER_RANK]


def grads(m: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in m.parameters()]


def worst(xs, ys) -> float:
    return max(rel_err(a, b) for a, b in zip(xs, ys))


def dp_bytes(spans) -> int:
    return sum(s.nbytes for s in spans if s.kind == "dp_all_reduce" and s.name.startswith("bucket"))


# -- DataParallel ---------------------------------------------------------------------------

def _grad_cases(rank: int, world: int, group) -> dict:
    from overlapkit.timeline import record

    out: dict = {}
    x, y = data(world)
    ref = mlp()
    F.mse_loss(ref(x), y).backward()
    ddp = nn.parallel.DistributedDataParallel(mlp(), process_group=group)
    F.mse_loss(ddp(local(x, rank, world)), local(y, rank, world)).backward()
    for name, (first, cap) in BUCKETS.items():
        for overlap in (True, False):
            m = DataParallel(mlp(), group, first_bucket_mb=first, bucket_mb=cap, overlap=overlap)
            F.mse_loss(m(local(x, rank, world)), local(y, rank, world)).backward()
            out[f"vs single process, {name}, overlap={overlap}"] = worst(grads(m.module), grads(ref))
            out[f"vs DDP, {name}, overlap={overlap}"] = worst(grads(m.module), grads(ddp.module))
            out[f"buckets, {name}"] = len(m.sync.buffer.buckets)

    # no_sync over k micro-batches == one backward on the k-times batch
    k = 3
    xk, yk = data(world, micro=k, seed=2)
    ref = mlp()
    F.mse_loss(ref(xk), yk).backward()
    m = DataParallel(mlp(), group, first_bucket_mb=1e-9, bucket_mb=400 / 2**20)
    with record() as rec:
        for j in range(k):
            loss = F.mse_loss(m(local(xk, rank, world, j)), local(yk, rank, world, j)) / k
            if j < k - 1:
                with m.no_sync():
                    loss.backward()
            else:
                loss.backward()
    out["no_sync vs k-times batch"] = worst(grads(m.module), grads(ref))
    out["no_sync reductions"] = sum(s.name == "bucket0" for s in rec.spans)

    # reduce in bf16 (fp32 grads), and in fp32 (bf16 grads)
    m = DataParallel(mlp(), group, grad_reduce_dtype=torch.bfloat16)
    with record() as rec:
        F.mse_loss(m(local(x, rank, world)), local(y, rank, world)).backward()
    ref = mlp()
    F.mse_loss(ref(x), y).backward()
    out["bf16 reduce vs fp32 single process"] = worst(grads(m.module), grads(ref))
    out["bf16 reduce bytes per element"] = dp_bytes(rec.spans) / m.sync.buffer.data.numel()
    m = DataParallel(mlp(dtype=torch.bfloat16), group, grad_reduce_dtype=torch.float32)
    with record() as rec:
        F.mse_loss(m(local(x, rank, world).bfloat16()), local(y, rank, world).bfloat16()).backward()
    per_rank = []
    for r in range(world):  # the exact reference: every rank's bf16 gradient, averaged in fp32
        ref = mlp(dtype=torch.bfloat16)
        F.mse_loss(ref(local(x, r, world).bfloat16()), local(y, r, world).bfloat16()).backward()
        per_rank.append([g.float() for g in grads(ref)])
    avg = [(sum(gs) / world).bfloat16() for gs in zip(*per_rank)]
    out["fp32 reduce of bf16 grads vs fp32 average"] = worst(grads(m.module), avg)
    out["fp32 reduce bytes per element"] = dp_bytes(rec.spans) / m.sync.buffer.data.numel()

    # tied weights: one gradient, reduced once
    idx = torch.randint(0, 11, (world * PER_RANK, 5), generator=torch.Generator().manual_seed(3))
    ref = Tied()
    ref(idx).square().mean().backward()
    m = DataParallel(Tied(), group, first_bucket_mb=1e-9, bucket_mb=1e-9)
    with record() as rec:
        m(local(idx, rank, world)).square().mean().backward()
    out["tied vs single process"] = worst(grads(m.module), grads(ref))
    out["tied params in buffer"] = len(m.sync.params)
    out["tied reduced elements"] = dp_bytes(rec.spans) // 4
    out["tied buffer elements"] = m.sync.buffer.data.numel()
    return out


def _unused_cases(rank: int, world: int, group) -> dict:
    out: dict = {}
    x, y = data(world)
    for where in ("everywhere", "on ranks > 0"):
        m = DataParallel(WithSpare(), group, first_bucket_mb=1e-9, bucket_mb=1e-9)
        use = where == "on ranks > 0" and rank == 0
        t0 = time.perf_counter()
        try:
            F.mse_loss(m(local(x, rank, world), use), local(y, rank, world)).backward()
            out[f"unused {where}"] = None
        except RuntimeError as e:
            out[f"unused {where}"] = str(e)
        out[f"unused {where} seconds"] = time.perf_counter() - t0
        # every collective completed: the group still pairs correctly afterwards
        t = torch.full((1,), float(rank + 1))
        comm.all_reduce(t, group, kind="dp_all_reduce", async_op=False)
        out[f"after unused {where}, sum of ranks"] = t.item()

    # find_unused: the ranks that skipped `spare` contribute zeros
    m = DataParallel(WithSpare(), group, find_unused=True, first_bucket_mb=1e-9, bucket_mb=400 / 2**20)
    F.mse_loss(m(local(x, rank, world), rank == 0), local(y, rank, world)).backward()
    ref = WithSpare()
    sum(F.mse_loss(ref(local(x, r, world), r == 0), local(y, r, world)) for r in range(world)).div(world).backward()
    out["find_unused vs single process"] = worst(grads(m.module), [p.grad for p in ref.parameters()])
    m = DataParallel(WithSpare(), group, find_unused=True)
    F.mse_loss(m(local(x, rank, world), False), local(y, rank, world)).backward()
    out["find_unused, unused everywhere, spare grad norm"] = m.module.spare.weight.grad.norm().item()
    return out


# -- ShardedOptimizer ---------------------------------------------------------------------

def _train(model_or_dp, opt, x, y, rank, world, steps):
    for _ in range(steps):
        opt.zero_grad()
        xs, ys = (x, y) if rank is None else (local(x, rank, world), local(y, rank, world))
        F.mse_loss(model_or_dp(xs), ys).backward()
        opt.step()


def _zero_cases(rank: int, world: int, group) -> dict:
    out: dict = {}
    x, y = data(world, seed=4)
    steps = 4
    kw = dict(lr=3e-2, weight_decay=0.1)
    for opt_cls in (torch.optim.Adam, torch.optim.AdamW):
        ref = mlp()
        _train(ref, opt_cls(ref.parameters(), **kw), x, y, None, world, steps)
        for name in ("one param per bucket", "one bucket"):
            first, cap = BUCKETS[name]
            for overlap in (True, False):
                m = DataParallel(mlp(), group, first_bucket_mb=first, bucket_mb=cap)
                opt = ShardedOptimizer(m, opt_cls, group, overlap_param_gather=overlap, **kw)
                _train(m, opt, x, y, rank, world, steps)
                opt.finish_param_gather()
                out[f"{opt_cls.__name__}, {name}, overlap_param_gather={overlap}"] = worst(
                    list(m.module.parameters()), list(ref.parameters()))
        model = mlp()
        opt = ShardedOptimizer(model.parameters(), opt_cls, group, overlap_param_gather=False, **kw)
        _train(model, opt, x, y, rank, world, steps)
        out[f"{opt_cls.__name__}, plain parameters"] = worst(list(model.parameters()), list(ref.parameters()))

    # state_dict round trip: 2 steps, save, fresh model + optimizer, load, 2 steps == 4 steps
    ref = mlp()
    _train(ref, torch.optim.AdamW(ref.parameters(), **kw), x, y, None, world, steps)
    m = DataParallel(mlp(), group, first_bucket_mb=100 / 2**20, bucket_mb=400 / 2**20)
    opt = ShardedOptimizer(m, torch.optim.AdamW, group, **kw)
    _train(m, opt, x, y, rank, world, steps // 2)
    blob = io.BytesIO()
    torch.save({"model": m.module.state_dict(), "opt": opt.state_dict()}, blob)
    blob.seek(0)
    saved = torch.load(blob)
    m2 = DataParallel(mlp(seed=7), group, first_bucket_mb=100 / 2**20, bucket_mb=400 / 2**20)
    opt2 = ShardedOptimizer(m2, torch.optim.AdamW, group, **kw)
    m2.module.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    _train(m2, opt2, x, y, rank, world, steps - steps // 2)
    opt2.finish_param_gather()
    out["state_dict round trip"] = worst(list(m2.module.parameters()), list(ref.parameters()))
    out["master dtype"] = str(opt2.master[0].dtype)

    # a shard saved by another rank fails on every rank, before the gather
    other = dict(saved["opt"], rank=(rank + 1) % world)
    try:
        opt2.load_state_dict(other if rank == world - 1 else saved["opt"])
        out["foreign shard"] = None
    except ValueError as e:
        out["foreign shard"] = str(e)
    return out


@functools.cache
def results(world: int) -> dict:
    return _all_cases(world)


@distributed(world_size=2, timeout_s=60.0)
def _all_two():
    return _run()


@distributed(world_size=3, timeout_s=60.0)
def _all_three():
    return _run()


def _all_cases(world: int) -> list[dict]:
    return _all_two() if world == 2 else _all_three()


def _run() -> dict:
    rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    out = {}
    out.update(_grad_cases(rank, world, group))
    out.update(_unused_cases(rank, world, group))
    out.update(_zero_cases(rank, world, group))
    return out
