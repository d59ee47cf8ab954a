"""Traces we make for the analyzer's tests: a tiny MLP trained on 2 gloo ranks, profiled per rank,
with overlapkit's DataParallel or with PyTorch's DistributedDataParallel."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, schedule

from distributed import distributed

STEPS = 3


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])


@distributed(world_size=2)
def _run(trace_dir: str, engine: str, sleep_rank: int | None = None, sleep_s: float = 0.0):
    import time

    model = _model()
    if engine == "overlapkit":
        from overlapkit.data_parallel import DataParallel

        model = DataParallel(model, dist.group.WORLD, bucket_mb=0.01, first_bucket_mb=0.01)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 64)
    path = f"{trace_dir}/rank{dist.get_rank()}.json"
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                 schedule=schedule(wait=0, warmup=1, active=STEPS, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(path)) as prof:
        for _ in range(STEPS + 1):
            if dist.get_rank() == sleep_rank:
                time.sleep(sleep_s)
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
            prof.step()
    return path


def profile_dataparallel(tmp_path) -> list[str]:
    return _run(str(tmp_path), "overlapkit")


def profile_ddp(tmp_path, sleep_rank=None, sleep_s=0.0) -> list[str]:
    return _run(str(tmp_path), "ddp", sleep_rank, sleep_s)
