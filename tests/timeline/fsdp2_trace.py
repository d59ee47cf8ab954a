"""Record a profiler trace of torch's plain FSDP2 (and of overlapkit's fully_shard) on gloo ranks.

`record(path, ours=False)` runs in a rank: a tiny model (root parameters `inp`/`out`, blocks
`layers.0..2`) sharded with `torch.distributed.fsdp.fully_shard` (or, `ours`, overlapkit's
`fully_shard` with host pauses that a prefetched gather can hide behind), one warm-up step, then one
profiled step (ProfilerStep#1 and #2; the reader keeps #1). tests/data/fsdp2_gloo_rank{0,1}.json.gz
were written by it on torch 2.13 (2 ranks):

    PYTHONPATH=src:tests python -c "from timeline.fsdp2_trace import main; main('tests/data')"
"""

from __future__ import annotations

import gzip
import os
import shutil
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile, schedule

SLEEP_S = 0.05
"""A host pause after block 0's forward (every rank): a gather prefetched before it can hide behind it."""
LATE_S = 0.03
"""Rank 1 starts block 0 this late: rank 0's prefetched gather of block 1 waits for it that long."""


class Tiny(nn.Module):
    def __init__(self, sleep: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16)) for _ in range(3))
        self.out = nn.Linear(16, 4)
        self.sleep = sleep

    def forward(self, x):
        h = self.inp(x)
        if self.sleep and dist.get_rank() == 1:
            time.sleep(LATE_S)
        for i, layer in enumerate(self.layers):
            h = h + layer(h)
            if self.sleep and i == 0:
                time.sleep(SLEEP_S)
        return self.out(h)


def record(path: str, ours: bool = False, prefetch: int = 1) -> str:
    """Profile one training step of Tiny on every rank; rank r writes `path` with `{rank}` filled."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = Tiny(sleep=ours)
    if ours:
        from overlapkit.data_parallel import fully_shard

        fully_shard(model, mesh, prefetch=prefetch)
    else:
        for layer in model.layers:
            torch_fully_shard(layer, mesh=mesh)
        torch_fully_shard(model, mesh=mesh)
    x = torch.randn(4, 8)
    model(x).sum().backward()  # warm-up: lazy init, connections
    out = path.format(rank=dist.get_rank())
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=0, active=2, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(out)) as prof:
        for _ in range(2):
            model(x).sum().backward()
            prof.step()
    return out


def main(out_dir: str) -> None:
    """Write fsdp2_gloo_rank{0,1}.json.gz into `out_dir` (2 gloo ranks, plain FSDP2)."""
    import tempfile

    from overlapkit.launch import spawn

    with tempfile.TemporaryDirectory() as d:
        paths = spawn(_write, 2, f"{d}/rank{{rank}}.json", backend="gloo", timeout_s=60.0)
        for rank, p in enumerate(paths):
            with open(p, "rb") as src, gzip.open(os.path.join(out_dir, f"fsdp2_gloo_rank{rank}.json.gz"), "wb") as dst:
                shutil.copyfileobj(src, dst)


def _write(path: str) -> str:
    return record(path)
