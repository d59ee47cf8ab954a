"""Cases the CP tests run inside spawned ranks (several per world: spawning is the expensive part)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from overlapkit.comm import group_rank, group_size
from overlapkit.context_parallel import ContextParallelConfig, ring_attention, shard

TOL = 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.detach().double() - b.detach().double()).abs().max() / b.detach().double().abs().max()).item()


def attention_errors(group, *, causal: bool, heads: int, kv_heads: int, config: ContextParallelConfig,
                     seq_per_rank: int = 4, batch: int = 2, dim: int = 8, seed: int = 0) -> float:
    """Max rel error of the local output and of the local q, k, v grads against one-process attention."""
    size, rank = group_size(group), group_rank(group)
    g = torch.Generator().manual_seed(seed)
    s = seq_per_rank * size
    q = torch.randn(batch, heads, s, dim, generator=g, requires_grad=True)
    k = torch.randn(batch, kv_heads, s, dim, generator=g, requires_grad=True)
    v = torch.randn(batch, kv_heads, s, dim, generator=g, requires_grad=True)
    dout = torch.randn(batch, heads, s, dim, generator=g)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=kv_heads != heads)
    ref.backward(dout)

    def mine(t):
        return shard(t.detach(), 2, rank, size, config.layout).requires_grad_()
    ql, kl, vl = mine(q), mine(k), mine(v)
    out = ring_attention(ql, kl, vl, group, causal=causal, config=config)
    out.backward(shard(dout, 2, rank, size, config.layout))
    pairs = [(out, ref), (ql.grad, q.grad), (kl.grad, k.grad), (vl.grad, v.grad)]
    return max(rel(a, shard(b, 2, rank, size, config.layout)) for a, b in pairs)


def all_attention_cases(group) -> dict[str, float]:
    """Causal and not, GQA and not, every layout, kernel and overlap mode: {case: max rel error}."""
    out = {}
    for causal in (True, False):
        for heads, kv_heads in ((2, 2), (4, 2)):
            for layout in ("zigzag", "contiguous"):
                for kernel in ("math", "flash"):
                    for overlap in ("pipelined", "none"):
                        if overlap == "none" and (kernel, layout) != ("math", "zigzag"):
                            continue  # the sequential schedule computes the same blocks; one form checks it
                        cfg = ContextParallelConfig(overlap=overlap, layout=layout, kernel=kernel)
                        key = f"causal={causal} h={heads}/{kv_heads} {layout} {kernel} {overlap}"
                        out[key] = attention_errors(group, causal=causal, heads=heads, kv_heads=kv_heads, config=cfg)
    return out
