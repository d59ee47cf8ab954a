"""A MoE forward waits for the GPU at most once, and its backward never: each host sync stalls the
host's dispatch until the GPU drains. On one EP rank without a capacity nothing needs the split sizes
on the host (no sync); with a capacity the padded path has fixed ones (no sync); only the exact-count
path with a capacity (pad_to_capacity=False) syncs, once (the kept rows' count)."""

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


def test_moe_forward_syncs_only_for_exact_capacity_counts_and_backward_never():
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
    for capacity, chunks, pad, syncs in ((None, 1, None, 0), (None, 4, None, 0), (None, "auto", None, 0),
                                         (1.25, 2, None, 0), (1.25, 2, False, 1)):
        moe = MoE(256, 512, 8, 2, dist.group.WORLD, chunks=chunks, capacity_factor=capacity, pad_to_capacity=pad,
                  device="cuda", dtype=torch.bfloat16)
        x = torch.randn(4, 256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        moe(x).float().square().mean().backward()  # warm-up: first-use allocations, probes
        out = {}
        fwd = _syncs(lambda: out.setdefault("y", moe(x)))
        loss = out["y"].float().square().mean()
        bwd = _syncs(lambda: loss.backward())
        print(f"capacity {capacity}, chunks {chunks}, pad {pad}: forward syncs {fwd}, backward syncs {bwd}")
        assert len(fwd) == syncs, fwd
        assert bwd == [], bwd
        assert moe.last_load.tokens == 4 * 256
