"""2-D parallelism: FSDP2 `fully_shard(mesh["dp"])` over overlapkit TP+SP on a (dp=2, tp=2) mesh, exact.

FSDP2 replaces every Parameter (and drops Python attributes); the norm's TP gradient sum must
survive that (mark_sequence_parallel re-hooks the tensors FSDP2 unshards for forward), and the
row bias gradient must be complete by itself. Every gradient equals a single-process reference
over the whole batch, on both [s, b, h] and [b, s, h] layouts, micro-batch 1 included, for two
steps. A run without the norm marked is shown to be wrong (so the test would see a lost sum).
"""

import torch
import torch.distributed as dist
from torch import nn

from distributed import distributed
from overlapkit.tensor_parallel import ColumnParallelLinear, RowParallelLinear, mark_sequence_parallel

H, F, S, DP, TP = 8, 16, 4, 2, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.fc1 = nn.Linear(H, F)
        self.fc2 = nn.Linear(F, H)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _run(mesh, overlap: str, sd: int, b: int, mark: bool = True) -> float:
    from torch.distributed.fsdp import fully_shard

    dp_rank, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    torch.manual_seed(21)
    ref = Block()
    with torch.no_grad():
        ref.norm.weight.uniform_(0.5, 1.5)  # not all ones: a wrong norm grad must show
        ref.norm.bias.uniform_(-0.5, 0.5)
    shape = (S, DP * b, H) if sd == 0 else (DP * b, S, H)
    bdim = 1 - sd
    model = Block()
    model.load_state_dict(ref.state_dict())
    kw = dict(sequence_parallel=True, sequence_dim=sd, overlap=overlap)
    model.fc1 = ColumnParallelLinear.from_full(model.fc1, mesh, **kw)
    model.fc2 = RowParallelLinear.from_full(model.fc2, mesh, **kw)
    if mark:
        mark_sequence_parallel(model.norm, mesh)
    fully_shard(model.norm, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    err = 0.0
    for step in range(2):
        X, G = torch.randn(*shape, requires_grad=True), torch.randn(*shape)
        ref.zero_grad()
        # FSDP2 averages over dp: the reference loss is the mean of the dp replicas' losses.
        ((ref(X) * G).sum() / DP).backward()
        x = X.detach().narrow(bdim, dp_rank * b, b).chunk(TP, sd)[tp_rank].contiguous().requires_grad_(True)
        g = G.narrow(bdim, dp_rank * b, b).chunk(TP, sd)[tp_rank]
        model.zero_grad()
        (model(x) * g).sum().backward()
        ref_grads = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            err = max(err, _rel(p.grad.full_tensor(), ref_grads[name].grad))
        # The input gradient is not averaged by FSDP2: the reference's carries the 1/DP.
        err = max(err, _rel(x.grad, DP * X.grad.narrow(bdim, dp_rank * b, b).chunk(TP, sd)[tp_rank]))
    return err


@distributed(world_size=4, timeout_s=90)
def _fsdp2_tp_sp():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    out = {(ov, sd, b): _run(mesh, ov, sd, b) for ov, sd, b in
           (("bulk", 1, 1), ("pipelined", 1, 2), ("pipelined", 0, 1), ("bulk", 0, 2))}
    out["unmarked"] = _run(mesh, "bulk", 1, 1, mark=False)
    dist.barrier()
    return out


def test_fsdp2_on_dp_times_overlapkit_tp_sp_gives_every_gradient_exactly():
    for out in _fsdp2_tp_sp():
        unmarked = out.pop("unmarked")
        for key, err in out.items():
            assert err <= 1e-5, (key, err)
        assert unmarked > 1e-3, unmarked  # without the TP sum the norm's gradient is a partial
