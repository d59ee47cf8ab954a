"""A plain single-process MoE, written independently of overlapkit.expert_parallel, to check it against."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def admitted(experts: torch.Tensor, num_experts: int, capacity_factor: float | None) -> torch.Tensor:
    """Keep-mask [tokens, top_k]: each expert admits ceil(f * T * k / E) assignments, first choices first."""
    tokens, top_k = experts.shape
    keep = torch.ones_like(experts, dtype=torch.bool)
    if capacity_factor is None:
        return keep
    capacity = math.ceil(capacity_factor * tokens * top_k / num_experts)
    taken = [0] * num_experts
    for j in range(top_k):
        for t in range(tokens):
            e = int(experts[t, j])
            keep[t, j] = taken[e] < capacity
            taken[e] += 1
    return keep


def reference_moe(x, gate, w1, b1, w2, b2, top_k, normalize=True, capacity_factor=None):
    """(out, aux_loss, dropped) for x [T, H] with full stacked experts; everything differentiable."""
    num_experts = gate.shape[0]
    probs = torch.softmax((x @ gate.t()).float(), -1)
    weights, experts = torch.topk(probs, top_k, -1)
    if normalize and top_k > 1:
        weights = weights / weights.sum(-1, keepdim=True)
    if x.shape[0]:
        f = torch.stack([(experts == e).sum() for e in range(num_experts)]).float() / experts.numel()
        aux = num_experts * (f * probs.mean(0)).sum()
    else:
        aux = probs.sum() * 0
    keep = admitted(experts, num_experts, capacity_factor)
    out = torch.zeros_like(x)
    for e in range(num_experts):
        t, j = ((experts == e) & keep).nonzero(as_tuple=True)
        if t.numel():
            y = F.linear(F.gelu(F.linear(x[t], w1[e], b1[e])), w2[e], b2[e])
            out = out.index_add(0, t, y * weights[t, j, None].to(x.dtype))
    return out, aux, int((~keep).sum())
