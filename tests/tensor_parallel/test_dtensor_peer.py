"""A real peer: PyTorch's own tensor parallelism (DTensor) on the same MLP gives the same numbers."""

import torch
import torch.distributed as dist
from torch import nn

from distributed import distributed
from overlapkit.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    def __init__(self, h: int, f: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(h, f)
        self.fc2 = nn.Linear(f, h)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _dtensor_mlp(mlp: MLP, ws: int, sp: bool) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (ws,))
    if sp:
        plan = {"fc1": ColwiseParallel(input_layouts=Shard(0)),
                "fc2": RowwiseParallel(output_layouts=Shard(0))}
    else:
        plan = {"fc1": ColwiseParallel(input_layouts=Replicate()),
                "fc2": RowwiseParallel(output_layouts=Replicate())}
    return parallelize_module(mlp, mesh, plan)


def _compare(sp: bool, overlap: str):
    group, ws, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    torch.manual_seed(7)
    h, f, s, b = 8, 4 * ws, 2 * ws, 3
    ref = MLP(h, f)
    X = torch.randn(s, b, h)
    G = torch.randn(s, b, h)

    ours = MLP(h, f)
    ours.load_state_dict(ref.state_dict())
    ours.fc1 = ColumnParallelLinear.from_full(ours.fc1, group, sequence_parallel=sp, overlap=overlap)
    ours.fc2 = RowParallelLinear.from_full(ours.fc2, group, sequence_parallel=sp, overlap=overlap)
    x = (X.chunk(ws, 0)[r] if sp else X).clone().requires_grad_(True)
    g = G.chunk(ws, 0)[r] if sp else G
    y = ours(x)
    (y * g).sum().backward()

    peer = MLP(h, f)
    peer.load_state_dict(ref.state_dict())
    peer = _dtensor_mlp(peer, ws, sp)
    xp = (X.chunk(ws, 0)[r] if sp else X).clone().requires_grad_(True)
    yp = peer(xp)
    (yp * g).sum().backward()
    yp = yp.to_local() if hasattr(yp, "to_local") else yp

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    diffs = {
        "out": (y - yp).abs().max().item(),
        "dx": (x.grad - xp.grad).abs().max().item(),
        "fc1.w": (local(ours.fc1.weight.grad) - local(peer.fc1.weight.grad)).abs().max().item(),
        "fc1.b": (local(ours.fc1.bias.grad) - local(peer.fc1.bias.grad)).abs().max().item(),
        "fc2.w": (local(ours.fc2.weight.grad) - local(peer.fc2.weight.grad)).abs().max().item(),
        # With SP too: both give the row bias its full gradient (DTensor's Partial -> Replicate; ours
        # from the gathered output gradient).
        "fc2.b": (local(ours.fc2.bias.grad) - local(peer.fc2.bias.grad)).abs().max().item(),
    }
    for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):  # the same DTensor placements as torch's
        mine, theirs = ours.get_parameter(name), peer.get_parameter(name)
        diffs[name + " placements"] = float(tuple(mine.placements) != tuple(theirs.placements))
    return diffs


@distributed(world_size=2)
def _peer2():
    return [_compare(sp, ov) for sp in (False, True) for ov in ("none", "bulk")]


@distributed(world_size=3)
def _peer3():
    return [_compare(sp, ov) for sp in (False, True) for ov in ("none", "bulk")]


def test_same_as_dtensor_tp_and_sp_ws2():
    for diffs in (d for rank in _peer2() for d in rank):
        assert max(diffs.values()) < 1e-5, diffs


def test_same_as_dtensor_tp_and_sp_ws3():
    for diffs in (d for rank in _peer3() for d in rank):
        assert max(diffs.values()) < 1e-5, diffs
