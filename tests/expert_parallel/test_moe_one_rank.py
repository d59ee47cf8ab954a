"""The MoE layer at one EP rank (no group: one process) in fp32 equals the single-process reference through
each path — exact counts (the loop on CPU, grouped GEMMs on CUDA, where nothing waits for the device) and
padded to a capacity (batched GEMMs) — forward and every gradient, at 1 and 3 chunks; on CPU, and on CUDA
where there is one. On the GPUs' path (dropless, or padded) the forward and backward, first call included, read
nothing back from the device: no host sync, so the layer is CUDA-graph capturable."""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from overlapkit.expert_parallel import MoE, init_full_experts
from overlapkit.expert_parallel import experts as X
from reference import reference_moe

DEVICES = ["cpu", "cpu-grouped",
           pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
"""cpu-grouped: CPU through the GPUs' path (grouped GEMMs, no split sizes read back to the host)."""


aten = torch.ops.aten
SYNCING = {aten._local_scalar_dense.default, aten.nonzero.default, aten.item.default}


class NoHostSync(TorchDispatchMode):
    """Fails on any op that would read a device value back to the host (what a CUDA graph's capture refuses), and on
    Tensor.tolist / numpy, which read a CPU tensor's memory without dispatching an op (on a GPU: a copy and a sync)."""

    def __enter__(self):
        self._saved = torch.Tensor.tolist, torch.Tensor.numpy

        def refuse(t, *_a, **_k):
            raise AssertionError("Tensor.tolist/numpy reads a device value back to the host")
        torch.Tensor.tolist = torch.Tensor.numpy = refuse
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist, torch.Tensor.numpy = self._saved
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        unsized = func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None
        if func in SYNCING or unsized:
            raise AssertionError(f"{func} reads a device value back to the host")
        return func(*args, **kwargs)


def test_the_sync_check_sees_a_sync():
    for read in (lambda t: t.nonzero(), lambda t: t.tolist(), lambda t: float(t.sum())):
        with pytest.raises(AssertionError, match="reads a device value"), NoHostSync():
            read(torch.tensor([1.0, 0.0]))
    assert torch.tensor([1, 2]).tolist() == [1, 2]  # restored after the mode


def test_the_per_expert_loop_is_seen_to_read_its_split_sizes():
    # The CPU loop path reads its split sizes on the host by design: the check must see that.
    moe = MoE(32, 48, 4, 2, None, overlap="none")
    with pytest.raises(AssertionError, match="reads a device value"), NoHostSync():
        moe(torch.randn(40, 32))


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


@pytest.mark.parametrize("capacity,pad", [(None, None), (1.0, True), (1.0, False), (0.6, True)])
@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("device", DEVICES)
def test_moe_paths_at_one_rank_match_the_reference_in_fp32(device, capacity, pad, chunks, monkeypatch):
    grouped = device != "cpu"
    if device == "cpu-grouped":
        monkeypatch.setattr(X, "GROUPED_DEVICES", {"cpu"})
        device = "cpu"
    H, F, E = 32, 48, 4
    torch.manual_seed(0)
    moe = MoE(H, F, E, 2, None, chunks=chunks, capacity_factor=capacity, pad_to_capacity=pad, device=device)
    g = torch.Generator().manual_seed(1)
    x, dy, gate = torch.randn(40, H, generator=g), torch.randn(40, H, generator=g), torch.randn(E, H, generator=g)
    full = init_full_experts(E, H, F, g)
    with torch.no_grad():
        moe.router.gate.weight.copy_(gate)
    moe.load_full(*full)
    xc = x.to(device, copy=True).requires_grad_()
    # The GPUs' path reads nothing back from the device (no split sizes, no counts) unless it must send exact
    # capacity-limited counts: there a sync-checking mode fails on any op that would stall a GPU's queue.
    syncless = grouped and (capacity is None or pad)
    with NoHostSync() if syncless else contextlib.nullcontext():
        out = moe(xc)
        ((out * dy.to(device)).sum() + 0.1 * moe.aux_loss).backward()
    ref = [p.clone().requires_grad_() for p in (gate, *full)]
    rx = x.clone().requires_grad_()
    o, aux, dropped = reference_moe(rx, *ref, 2, True, capacity)
    ((o * dy).sum() + 0.1 * aux).backward()
    e = moe.experts
    errs = [_rel(out.cpu(), o), _rel(xc.grad.cpu(), rx.grad), _rel(moe.router.gate.weight.grad.cpu(), ref[0].grad)]
    errs += [_rel(p.grad.cpu(), r.grad) for p, r in zip((e.w1, e.b1, e.w2, e.b2), ref[1:])]
    assert max(errs) <= 1e-5, errs
    assert moe.last_load.dropped == dropped


@pytest.mark.parametrize("capacity,pad", [(None, None), (1.25, True), (1.25, False)])
def test_moe_under_autocast_runs_each_path_in_the_autocast_dtype(capacity, pad):
    # Under autocast the layer casts its input and expert weights itself (as autocast would for a linear) and
    # runs the expert functions with autocast off: one dtype inside, fp32 gradients on the fp32 parameters.
    torch.manual_seed(0)
    moe = MoE(16, 32, 4, 2, None, chunks=2, capacity_factor=capacity, pad_to_capacity=pad)
    x = torch.randn(24, 16)
    ref = moe(x).detach()
    xb = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = moe(xb)
    out.float().square().sum().backward()
    assert out.dtype == torch.bfloat16 and _rel(out.float(), ref) < 2e-2
    e = moe.experts
    assert xb.grad.dtype == torch.float32 and all(p.grad is not None and p.grad.dtype == torch.float32
                                                  for p in (e.w1, e.b1, e.w2, e.b2))
