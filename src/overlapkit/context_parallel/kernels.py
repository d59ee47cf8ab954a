"""Attention of one query block against one key/value block, returning the log-sum-exp the ring merges with.

Nothing here communicates: these are the computations the ring hides its key/value transfers
behind. Each block's output is normalized by its own softmax sum and comes with
lse = log Σ exp(scores) per query row, so blocks merge exactly (`merge`). The backward of a
block takes the *merged* output and lse of the whole row: then exp(scores − lse) is the true
attention probability and the block's dq, dk, dv are exact parts of the full gradient.

Kernels: ``math`` (matmuls, any dtype and device, grouped-query heads without copying k/v;
scores in fp32), ``flash`` (PyTorch's fused kernels). On CUDA ``flash`` is cuDNN's fused attention
where the build runs it for the block (`_scaled_dot_product_cudnn_attention`, grouped-query heads
native: what scaled_dot_product_attention itself picks on Hopper, 1.7x faster there than the flash
kernel, cp_kernel_probe_h200.md), else `_scaled_dot_product_flash_attention`; on CPU
`_scaled_dot_product_flash_attention_for_cpu`. The flash kernels get k/v heads repeated for
grouped-query attention.
"""

from __future__ import annotations

import torch

from ..runtime import state

KERNELS = ("math", "flash")
"""Block-attention implementations."""

aten = torch.ops.aten

_CUDNN_BROKEN: set = state.capability_set("ring_attention.cudnn_refused")
"""(dtype, head dim) for which this build's cuDNN attention refused a block once: flash from then on."""


def _cudnn_forward(q, k, v, causal: bool, scale: float):
    """cuDNN's (out, lse [b, h, sq], rest) of one block, or None where it is unavailable or refuses."""
    key = (q.dtype, q.shape[-1])
    if not hasattr(aten, "_scaled_dot_product_cudnn_attention") or key in _CUDNN_BROKEN:
        return None
    try:
        r = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError:
        _CUDNN_BROKEN.add(key)
        return None
    out, lse = r[0], r[1]
    b, h, sq, _ = q.shape
    if tuple(lse.shape) not in ((b, h, sq), (b, h, sq, 1)):  # a layout the merge does not know: do not guess
        _CUDNN_BROKEN.add(key)
        return None
    # The backward takes the lse in the kernel's own shape and layout: kept beside its other outputs.
    return out.float(), lse.float().reshape(b, h, sq), ("cudnn", tuple(lse.shape), lse.dtype, r[2:8])


def check_kernel(kernel: str, q: torch.Tensor) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not one of {KERNELS}")
    if kernel == "flash" and q.is_cuda and q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"kernel='flash' on CUDA needs float16 or bfloat16 inputs, got {q.dtype}; use kernel='math'")


def _causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    # Only diagonal blocks are causal: the same chunk for queries and keys (sq == sk, top-left aligned).
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()


def _scores(q, k, causal, scale):
    """fp32 scores [b, hk, g, sq, sk] of q [b, h, sq, d] against k [b, hk, sk, d] (h = hk * g)."""
    b, h, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    qg = q.float().view(b, hk, h // hk, sq, d)
    s = torch.matmul(qg, k.float().unsqueeze(2).transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~_causal_mask(sq, sk, q.device), float("-inf"))
    return qg, s


def _expand(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _fold(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Sum the gradient of repeated k/v heads back onto their shared head."""
    if groups == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // groups, groups, s, d).sum(2)


def block_forward(q, k, v, causal: bool, scale: float, kernel: str = "math"):
    """(out fp32 [b, h, sq, d], lse fp32 [b, h, sq], rest) of q against one key/value block.

    `rest` is what the kernel's backward needs besides the tensors (None for math).
    """
    b, h, sq, d = q.shape
    groups = h // k.shape[1]
    if kernel == "math":
        _, s = _scores(q, k, causal, scale)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.unsqueeze(-1))
        out = torch.matmul(p, v.float().unsqueeze(2))
        return out.view(b, h, sq, d), lse.view(b, h, sq), None
    if q.is_cuda:
        done = _cudnn_forward(q, k, v, causal, scale)
        if done is not None:
            return done
    ke, ve = _expand(k, groups), _expand(v, groups)
    if q.is_cuda:
        out, lse, cum_q, cum_k, _, _, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, ke, ve, 0.0, causal, False, scale=scale)
        return out.float(), lse.float(), ("flash", cum_q, cum_k, seed, offset)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, ke, ve, 0.0, causal, scale=scale)
    return out.float(), lse.float(), None


def block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, kernel: str = "math", rest=None):
    """(dq, dk, dv) in fp32 of one block, given the merged `out` and `lse` of these query rows."""
    b, h, sq, d = q.shape
    hk = k.shape[1]
    groups = h // hk
    if kernel == "math":
        qg, s = _scores(q, k, causal, scale)
        p = torch.exp(s - lse.view(b, hk, groups, sq, 1))
        dog = dout.float().view(b, hk, groups, sq, d)
        dv = torch.matmul(p.transpose(-1, -2), dog).sum(2)
        dp = torch.matmul(dog, v.float().unsqueeze(2).transpose(-1, -2))
        delta = (dog * out.float().view(b, hk, groups, sq, d)).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        dq = torch.matmul(ds, k.float().unsqueeze(2)) * scale
        dk = torch.matmul(ds.transpose(-1, -2), qg).sum(2) * scale
        return dq.view(b, h, sq, d), dk, dv
    o, do = out.to(q.dtype).contiguous(), dout.to(q.dtype).contiguous()
    if q.is_cuda and rest[0] == "cudnn":
        _, lse_shape, lse_dtype, (cum_q, cum_k, max_q, max_k, seed, offset) = rest
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
            do, q, k, v, o, lse.reshape(lse_shape).to(lse_dtype).contiguous(), seed, offset, None, cum_q, cum_k,
            max_q, max_k, 0.0, causal, scale=scale)
        return dq.float(), dk.float(), dv.float()
    ke, ve = _expand(k, groups), _expand(v, groups)
    l = lse.contiguous()
    if q.is_cuda:
        _, cum_q, cum_k, seed, offset = rest
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            do, q, ke, ve, o, l, cum_q, cum_k, sq, k.shape[2], 0.0, causal, seed, offset, scale=scale)
    else:
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, ke, ve, o, l, 0.0, causal, scale=scale)
    return dq.float(), _fold(dk.float(), groups), _fold(dv.float(), groups)


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold a block's (out, lse) into the running (out, lse) of the same rows, in place (online softmax)."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)
