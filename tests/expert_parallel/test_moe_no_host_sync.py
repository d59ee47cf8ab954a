"""At one rank the MoE layer's forward and backward read nothing back from the device (no item, nonzero or
unsized repeat_interleave: what stalls a GPU's queue and what a CUDA graph's capture refuses), through the
GPUs' grouped-GEMM path (switched on for CPU here) dropless and padded to a capacity, and stay exact against
the single-process reference."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from overlapkit.expert_parallel import MoE, init_full_experts
from overlapkit.expert_parallel import experts as X
from reference import reference_moe

aten = torch.ops.aten
SYNCING = {aten._local_scalar_dense.default, aten.nonzero.default, aten.item.default}


class NoHostSync(TorchDispatchMode):
    """Fails on any op that would read a device value back to the host."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        unsized = func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None
        if func in SYNCING or unsized:
            raise AssertionError(f"{func} reads a device value back to the host")
        return func(*args, **kwargs)


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


@pytest.mark.parametrize("capacity,pad", [(None, None), (1.0, True)])
@pytest.mark.parametrize("chunks", [1, 3])
def test_moe_at_one_rank_syncs_nothing_and_is_exact(capacity, pad, chunks, monkeypatch):
    monkeypatch.setattr(X, "GROUPED_DEVICES", {"cpu"})
    H, F, E, K = 32, 48, 4, 2
    torch.manual_seed(0)
    moe = MoE(H, F, E, K, None, overlap="none" if chunks == 1 else "pipelined", chunks=None if chunks == 1 else chunks,
              capacity_factor=capacity, pad_to_capacity=pad)
    g = torch.Generator().manual_seed(1)
    x, dy, gate = torch.randn(40, H, generator=g), torch.randn(40, H, generator=g), torch.randn(E, H, generator=g)
    full = init_full_experts(E, H, F, g)
    with torch.no_grad():
        moe.router.gate.weight.copy_(gate)
    moe.load_full(*full)
    moe(x.clone().requires_grad_()).sum().backward()  # first call: agreement and capability checks
    moe.zero_grad(set_to_none=True)
    xc = x.clone().requires_grad_()
    with NoHostSync():
        out = moe(xc)
        ((out * dy).sum() + 0.1 * moe.aux_loss).backward()
    ref = [p.clone().requires_grad_() for p in (gate, *full)]
    rx = x.clone().requires_grad_()
    o, aux, _ = reference_moe(rx, *ref, K, True, capacity)
    ((o * dy).sum() + 0.1 * aux).backward()
    e = moe.experts
    errs = [_rel(out, o), _rel(xc.grad, rx.grad), _rel(moe.router.gate.weight.grad, ref[0].grad)]
    errs += [_rel(p.grad, r.grad) for p, r in zip((e.w1, e.b1, e.w2, e.b2), ref[1:])]
    assert max(errs) <= 1e-5, errs


def test_the_sync_check_sees_a_sync():
    with pytest.raises(AssertionError, match="reads a device value"), NoHostSync():
        torch.tensor([1.0, 0.0]).nonzero()
