"""Our ParallelStyles inside torch's own parallelize_module: same numbers as torch's DTensor styles, in place."""

import torch
import torch.distributed as dist
from torch import nn

from distributed import distributed
from overlapkit.tensor_parallel import (ColumnParallelLinear, ColwiseParallel, GatherSequence, RowParallelLinear,
                                        RowwiseParallel, ScatterSequence, SequenceParallel)


class Block(nn.Module):
    """norm -> fc1 -> gelu -> fc2 on [batch, seq, hidden] (the sequence is dim 1, as in HF)."""

    def __init__(self, h: int, f: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, f)
        self.fc2 = nn.Linear(f, h)

    def forward(self, x):
        return self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


def _local(t):
    """A DTensor's local data, with a pending (Partial) sum done first: torch's SP norm grads are Partial."""
    if not hasattr(t, "to_local"):
        return t
    from torch.distributed.tensor import Replicate
    if any(p.is_partial() for p in t.placements):
        t = t.redistribute(placements=[Replicate() if p.is_partial() else p for p in t.placements])
    return t.to_local()


def _rel(a, b):
    a, b = _local(a), _local(b)
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _ours_vs_torch(sp: bool, overlap: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
    from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise
    from torch.distributed.tensor.parallel import SequenceParallel as TorchSP
    from torch.distributed.tensor.parallel import parallelize_module

    ws, r = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",))
    torch.manual_seed(7)
    h, f, b, s = 8, 4 * ws, 2, 2 * ws
    ref = Block(h, f)
    X = torch.randn(b, s, h)
    G = torch.randn(b, s, h)

    ours = Block(h, f)
    ours.load_state_dict(ref.state_dict())
    fc1, seen = ours.fc1, []
    fc1.register_forward_hook(lambda m, i, o: seen.append(o.shape))  # a user's hook survives the swap
    opts = dict(overlap=overlap, sequence_parallel=sp, sequence_dim=1) if sp else dict(overlap=overlap)
    plan = {"fc1": ColwiseParallel(**opts), "fc2": RowwiseParallel(**opts)}
    if sp:
        plan["norm"] = SequenceParallel()
    out = parallelize_module(ours, mesh, plan)
    assert out is ours and ours.fc1 is fc1 and isinstance(fc1, ColumnParallelLinear)
    assert isinstance(ours.fc2, RowParallelLinear) and fc1.name == "Linear"
    x = (X.chunk(ws, 1)[r] if sp else X).clone().requires_grad_(True)
    g = G.chunk(ws, 1)[r] if sp else G
    (ours(x) * g).sum().backward()
    assert seen == [torch.Size([b, s, f // ws])]

    peer = Block(h, f)
    peer.load_state_dict(ref.state_dict())
    if sp:
        peer_plan = {"norm": TorchSP(sequence_dim=1), "fc1": TorchColwise(input_layouts=Shard(1)),
                     "fc2": TorchRowwise(output_layouts=Shard(1))}
    else:
        peer_plan = {"fc1": TorchColwise(input_layouts=Replicate()), "fc2": TorchRowwise(output_layouts=Replicate())}
    peer = parallelize_module(peer, mesh, peer_plan)
    xp = (X.chunk(ws, 1)[r] if sp else X).clone().requires_grad_(True)
    yp = peer(xp)
    (yp * g).sum().backward()
    errs = {"out": _rel(ours(x), yp), "dx": _rel(x.grad, xp.grad)}
    for name, p in ours.named_parameters():
        errs[name] = _rel(p.grad, dict(peer.named_parameters())[name].grad)
    sd = ours.state_dict()
    errs["state_dict"] = _rel(sd["fc1.weight"].full_tensor(), ref.fc1.weight)
    return errs


def _gather_scatter() -> float:
    """ScatterSequence then GatherSequence on dim 1 is the identity, forward and backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    ws = dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",))
    model = nn.Sequential(nn.Identity(), nn.Identity())
    parallelize_module(model, mesh, {"0": ScatterSequence(sequence_dim=1), "1": GatherSequence(sequence_dim=1)})
    x = torch.randn(2, 3 * ws, 4, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    y = model[0](x)
    assert y.shape == (2, 3, 4)
    out = model[1](y)
    out.backward(torch.ones_like(out))
    # forward: identity; backward: every rank's partial (ones) summed by the reduce-scatter.
    return max(_rel(out, x), _rel(x.grad, torch.full_like(x, float(ws))))


@distributed(world_size=2)
def _tp2():
    return [_ours_vs_torch(sp, ov) for sp, ov in ((False, "none"), (False, "bulk"), (True, "bulk"),
                                                   (True, "pipelined"))] + [{"gather_scatter": _gather_scatter()}]


@distributed(world_size=3)
def _tp3():
    return [_ours_vs_torch(True, "none"), {"gather_scatter": _gather_scatter()}]


def test_styles_equal_torch_styles_tp2():
    for per_rank in _tp2():
        for errs in per_rank:
            for key, err in errs.items():
                assert err <= 1e-5, (key, err)


def test_styles_equal_torch_styles_tp3():
    for per_rank in _tp3():
        for errs in per_rank:
            for key, err in errs.items():
                assert err <= 1e-5, (key, err)
