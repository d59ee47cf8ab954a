"""A MoE forward waits for the GPU once (the split sizes every all-to-all needs on the host), and
its backward not at all: each host sync stalls the host's dispatch until the GPU drains."""

import warnings

import torch
import torch.distributed as dist

from overlapkit.expert_parallel import MoE


def _syncs(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}" for w in caught if "called a synchronizing" in str(w.message)]


def test_moe_forward_syncs_once_and_backward_never():
    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29733", rank=0, world_size=1)
    try:
        _check_syncs()
    finally:
        if mine:
            dist.destroy_process_group()


def _check_syncs():
    torch.manual_seed(0)
    for capacity, chunks in ((None, 1), (None, 4), (1.25, 2)):
        moe = MoE(256, 512, 8, 2, dist.group.WORLD, chunks=chunks, capacity_factor=capacity,
                  device="cuda", dtype=torch.bfloat16)
        x = torch.randn(4, 256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        moe(x).float().square().mean().backward()  # warm-up: first-use allocations, probes
        out = {}
        fwd = _syncs(lambda: out.setdefault("y", moe(x)))
        loss = out["y"].float().square().mean()
        bwd = _syncs(lambda: loss.backward())
        print(f"capacity {capacity}, chunks {chunks}: forward syncs {fwd}, backward syncs {bwd}")
        assert len(fwd) == 1, fwd
        assert bwd == [], bwd
        assert moe.last_load.tokens == 4 * 256
