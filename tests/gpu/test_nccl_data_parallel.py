"""DataParallel and ShardedOptimizer on CUDA over NCCL, one rank per GPU (world size 1 on one GPU):
the same answers as one process, and the recorder's CUDA-event spans of the bucket reductions."""

import torch
import torch.distributed as dist
from torch.nn import functional as F

from data_parallel.dp_cases import BUCKETS, data, local, mlp, worst
from distributed import distributed
from overlapkit.data_parallel import DataParallel, ShardedOptimizer
from overlapkit.timeline import record
from overlapkit.timeline.report import measure

TOL = 1e-5


@distributed(world_size=None, backend="nccl", timeout_s=120)
def _nccl_cases():
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference check is fp32-exact
    return cases(torch.device("cuda", torch.cuda.current_device()))


def cases(dev: torch.device) -> dict:
    rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    x, y = (t.to(dev) for t in data(world))
    out = {}
    ref = mlp().to(dev)
    F.mse_loss(ref(x), y).backward()
    ref_grads = [p.grad for p in ref.parameters()]
    for name, (first, cap) in BUCKETS.items():
        for overlap in (True, False):
            m = DataParallel(mlp().to(dev), group, first_bucket_mb=first, bucket_mb=cap, overlap=overlap)
            with record(device=dev) as rec:
                F.mse_loss(m(local(x, rank, world)), local(y, rank, world)).backward()
            out[f"grads, {name}, overlap={overlap}"] = worst([p.grad for p in m.module.parameters()], ref_grads)
            buckets = [s for s in rec.spans if s.kind == "dp_all_reduce" and s.name.startswith("bucket")]
            # One all-reduce per bucket; none at world size 1, where the gradient is its own average.
            out[f"recorded buckets, {name}, overlap={overlap}"] = (len(buckets),
                                                                   len(m.sync.buffer.buckets) if world > 1 else 0)
            out[f"recorded comm ms, {name}, overlap={overlap}"] = measure(rec.spans).comm_ms if world > 1 else 1.0
    for overlap in (True, False):
        ref = mlp().to(dev)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-2)
        m = DataParallel(mlp().to(dev), group, first_bucket_mb=1e-9, bucket_mb=1e-9)
        opt = ShardedOptimizer(m, torch.optim.AdamW, group, overlap_param_gather=overlap, lr=3e-2)
        for _ in range(3):
            ref_opt.zero_grad()
            F.mse_loss(ref(x), y).backward()
            ref_opt.step()
            opt.zero_grad()
            F.mse_loss(m(local(x, rank, world)), local(y, rank, world)).backward()
            opt.step()
        opt.finish_param_gather()
        out[f"sharded AdamW, overlap_param_gather={overlap}"] = worst(list(m.module.parameters()),
                                                                      list(ref.parameters()))
    return out


def test_data_parallel_on_nccl():
    for r in _nccl_cases():
        for key, value in r.items():
            if key.startswith(("grads", "sharded")):
                assert value <= TOL, (key, value)
            elif key.startswith("recorded buckets"):
                assert value[0] == value[1], (key, value)  # one recorded all-reduce per bucket
            elif key.startswith("recorded comm ms"):
                assert value > 0.0, (key, value)
