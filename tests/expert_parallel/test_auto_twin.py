"""After chunks="auto" has decided, the layer is its twin fixed at the kept count: a step runs the same aten ops
on the same shapes, the same collectives in the same order, with the same hooks, and the layer holds the same
tensors (the trials' per-count constants are gone)."""

import torch
import torch.distributed as dist

from distributed import distributed
from overlapkit.expert_parallel import MoE
from step_trace import differences, step_trace


@distributed(world_size=2, timeout_s=120)
def _decided_vs_twin() -> dict:
    torch.manual_seed(0)
    auto = MoE(32, 64, 4, 2, dist.group.WORLD, name="moe")
    x = torch.randn(48, 32)
    calls = 0
    while auto.chunks is None:
        auto(x.requires_grad_()).sum().backward()
        calls += 1
    c = auto.chunks
    torch.manual_seed(0)
    twin = MoE(32, 64, 4, 2, dist.group.WORLD, name="moe", overlap="none" if c == 1 else "pipelined",
               chunks=None if c == 1 else c)
    for m in (auto, twin):
        for _ in range(2):
            m(x).sum().backward()
    a = step_trace(auto, lambda: auto(x).sum().backward())
    b = step_trace(twin, lambda: twin(x).sum().backward())
    return dict(chunks=c, calls=calls, diff=differences(a, b), ops=len(a["ops"]), comms=len(a["comms"]), held=a["held"])


def test_decided_auto_traces_as_its_fixed_twin():
    for r in _decided_vs_twin():
        assert r["calls"] > 1 and r["ops"] > 50 and r["comms"] >= 5 and r["held"][0] >= 5, r
        assert r["diff"] == {}, (r["chunks"], r["diff"])
