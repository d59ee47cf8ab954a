"""Where a MoE forward and backward wait for the GPU: each piece run under
torch.cuda.set_sync_debug_mode("error"), the first synchronizing call's Python traceback printed.
Diagnostic for tests/gpu/test_moe_host_syncs_cuda.py (CUDA only).

    python benchmarks/ep_sync_sites.py
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from overlapkit.expert_parallel import MoE  # noqa: E402
from overlapkit.expert_parallel.dispatch import ExpertsA2A, plan_dispatch  # noqa: E402


def first_sync(label: str, fn) -> object:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = fn()
        print(f"{label}: no sync")
        return out
    except RuntimeError as e:
        print(f"{label}: SYNC -> {str(e).splitlines()[0]}")
        traceback.print_exc(limit=-6)
        return None
    finally:
        torch.cuda.set_sync_debug_mode("default")


def main() -> int:
    if not torch.cuda.is_available():
        print("CUDA only", file=sys.stderr)
        return 2
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29734", rank=0, world_size=1)
    torch.manual_seed(0)
    moe = MoE(256, 512, 8, 2, dist.group.WORLD, chunks=2, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4, 256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    moe(x).float().square().mean().backward()
    x2 = x.reshape(-1, 256)
    routing = first_sync("router", lambda: moe.router(x2))
    routing = routing or moe.router(x2)
    first_sync("plan (expected: the counts' .tolist())", lambda: plan_dispatch(routing.experts, 8, 2, None, moe.group, "m"))
    plan = plan_dispatch(routing.experts, 8, 2, None, moe.group, "m")
    e = moe.experts
    rows = first_sync("gather rows", lambda: x2[plan.row_token])
    y = first_sync("experts", lambda: ExpertsA2A.apply(rows, e.w1, e.b1, e.w2, e.b2, plan, moe.group, True, "m"))
    out = first_sync("combine", lambda: x2.new_zeros(x2.shape).index_add(
        0, plan.row_token, y * routing.weights.reshape(-1)[plan.row_assignment][:, None]))
    loss = out.float().square().mean()
    first_sync("backward", lambda: loss.backward())
    y2 = moe(x)
    first_sync("last_load (expected)", lambda: moe.last_load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
