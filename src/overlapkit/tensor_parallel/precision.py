"""Mixed precision for the tensor-parallel autograd functions: what torch.autocast would do, done once, outside.

Nothing here overlaps anything. torch.autocast casts the inputs of each op it knows; inside
our autograd functions that would make a GEMM's output bf16 while the buffer its partial
sum travels into is fp32 (the pipelined reduce-scatter returned garbage that way). So a
layer under autocast casts its input, weight and bias to the autocast dtype itself, as
autocast would for `F.linear` (differentiably: the gradients return to the fp32
parameters in fp32), and runs its function with autocast off, every tensor in one dtype.
"""

from __future__ import annotations

import contextlib

import torch

from ..runtime import state

_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)
"""Dtypes autocast lowers; float64 stays float64, as under autocast."""


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would run a linear of `x` in, or None when autocast is off for its device."""
    dt = x.device.type
    if dt not in ("cuda", "cpu", "xpu") or not torch.is_autocast_enabled(dt) or x.dtype not in _CASTABLE:
        return None
    return torch.get_autocast_dtype(dt)


def cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """`t` in `dtype` (differentiable; a no-op when already there or when dtype is None)."""
    if t is None or dtype is None or t.dtype == dtype:
        return t
    return t.to(dtype)


def autocast_off(x: torch.Tensor, dtype: torch.dtype | None):
    """A context with autocast disabled for x's device when a dtype was picked, else nothing."""
    return torch.autocast(x.device.type, enabled=False) if dtype is not None else contextlib.nullcontext()


_FUSED_ACCUMULATE: dict = state.capability_dict("fused_addmm_accumulate")
"""device -> whether torch.addmm(..., out_dtype=, out=acc) accumulates there in one GEMM (probed once)."""


def addmm_accumulate_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc += a @ b, with `acc` in a wider dtype than a and b (fp32 over bf16 chunks of a wgrad).

    Where torch has it (CUDA's addmm with out_dtype), one GEMM adds into `acc` in its epilogue,
    with no rounding of the product to bf16; elsewhere a bf16 product, then an fp32 add (a
    second pass over a weight-sized matrix per chunk, what the chunked wgrad paid on the H200).
    """
    if acc.dtype == a.dtype:
        return acc.addmm_(a, b)
    if _fused_accumulate(acc.device, a.dtype, acc.dtype):
        return torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    return acc.add_(torch.mm(a, b))


def _fused_accumulate(device: torch.device, low: torch.dtype, high: torch.dtype) -> bool:
    if device.type != "cuda":
        return False
    key = (device, low, high)
    ok = _FUSED_ACCUMULATE.get(key)
    if ok is None:
        if torch.cuda.is_current_stream_capturing():
            return False  # the probe syncs: decide on a call outside the capture
        try:
            c = torch.ones(2, 2, device=device, dtype=high)
            x = torch.ones(2, 2, device=device, dtype=low)
            torch.addmm(c, x, x, out_dtype=high, out=c)
            ok = bool(torch.equal(c, torch.full_like(c, 3.0)))  # 1 + 2: the sum really went into c
        except (RuntimeError, TypeError, NotImplementedError):
            ok = False
        _FUSED_ACCUMULATE[key] = ok
    return ok
