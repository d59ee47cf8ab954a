"""ZeRO-3 over dp composed with overlapkit TP over tp on one 2-D mesh (dp=2 x tp=2, 4 gloo ranks):
equal to one process and to plain FSDP2 on the same TP model, at prefetch 1 and auto."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from distributed import distributed
from overlapkit.data_parallel import fully_shard, prefetch_plan
from overlapkit.tensor_parallel import ColumnParallelLinear, RowParallelLinear

TOL = 1e-5
PER_RANK, STEPS, HIDDEN, FFN = 3, 4, 6, 10


class Block(nn.Module):
    def __init__(self, fc1, fc2):
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, h):
        return h + self.fc2(torch.tanh(self.fc1(h)))


class Net(nn.Module):
    """Three MLP blocks; with a mesh their linears are overlapkit's column/row TP layers."""

    def __init__(self, mesh=None):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(5, HIDDEN)
        pairs = [(nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)) for _ in range(3)]
        if mesh is not None:
            pairs = [(ColumnParallelLinear.from_full(a, mesh), RowParallelLinear.from_full(b, mesh)) for a, b in pairs]
        self.blocks = nn.ModuleList(Block(a, b) for a, b in pairs)
        self.out = nn.Linear(HIDDEN, 3)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(model, x, y):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(STEPS):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return [_full(p.grad) for p in model.parameters()] + [_full(p).detach() for p in model.parameters()]


def _err(a, b):
    return max(((u.double() - v.double()).norm() / v.double().norm().clamp_min(1e-30)).item() for u, v in zip(a, b))


@distributed(world_size=4, timeout_s=90.0)
def _two_d():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_local_rank("dp")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2 * PER_RANK, 5, generator=g), torch.randn(2 * PER_RANK, 3, generator=g)
    sl = slice(dp * PER_RANK, (dp + 1) * PER_RANK)  # the two TP ranks of a DP rank see the same rows
    out = {}
    ref = _train(Net(), x, y)
    plain = Net(mesh)
    for b in plain.blocks:
        torch_fully_shard(b, mesh=mesh["dp"])
    torch_fully_shard(plain, mesh=mesh["dp"])
    peer = _train(plain, x[sl], y[sl])
    for p in (1, "auto"):
        m = fully_shard(Net(mesh), mesh, prefetch=p, trials=0)  # auto: the model's pick (trials: test_fsdp.py)
        mine = _train(m, x[sl], y[sl])
        out[f"prefetch={p} vs single process"] = _err(mine, ref)
        out[f"prefetch={p} vs FSDP2"] = _err(mine, peer)
        out[f"prefetch={p} placements"] = str(m.blocks[0].fc1.weight.placements)
        out[f"prefetch={p} decided"] = prefetch_plan(m).decided
    out["plain placements"] = str(plain.blocks[0].fc1.weight.placements)
    out["world"] = dist.get_world_size()
    return out


@functools.cache
def results():
    return _two_d()


def test_zero3_with_overlapkit_tp_matches_single_process_and_fsdp2():
    for r in results():
        for p in (1, "auto"):
            assert r[f"prefetch={p} vs single process"] <= TOL, r
            assert r[f"prefetch={p} vs FSDP2"] <= TOL, r
            assert r[f"prefetch={p} decided"], r
            # sharded on dp (dim 0 of the TP shard) and on tp: a 2-D DTensor
            assert r[f"prefetch={p} placements"] == r["plain placements"], r
            assert "Shard(dim=0)" in r[f"prefetch={p} placements"], r
