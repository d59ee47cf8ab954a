"""The MoE router: softmax top-k gating with the auxiliary load-balancing loss; it overlaps nothing.

It decides which experts each token goes to, which is what the dispatch all-to-all then moves.
The softmax runs in fp32 whatever the activations' dtype, so the choice of experts does not
flip with rounding between a bf16 run and its fp32 reference more than it must.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from .experts import count


class Routing(NamedTuple):
    """Where a rank's tokens go and with what weight."""

    weights: torch.Tensor
    """[tokens, top_k], the activations' dtype: each chosen expert's share of the token's output."""
    experts: torch.Tensor
    """[tokens, top_k], int64: the chosen experts (global ids), best first."""
    probs: torch.Tensor
    """[tokens, num_experts], fp32: the softmax over all experts."""
    aux_loss: torch.Tensor
    """Scalar: the load-balancing loss of these tokens (see `load_balancing_loss`)."""
    counts: torch.Tensor
    """[num_experts] int64: the (token, choice) assignments each expert got (before any capacity), counted
    once here for the loss and reused by the dispatch plan."""


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
    """Switch Transformer's auxiliary loss, E * sum_e f_e * P_e, over one rank's tokens.

    f_e is the fraction of the (token, choice) assignments that went to expert e (not
    differentiable), P_e the mean router probability of expert e. It is 1 under a perfectly
    even spread and grows towards E as the routing collapses onto one expert. Zero tokens give 0.
    `counts` ([E], the assignments per expert) saves counting them again where the caller has them.
    """
    tokens, num_experts = probs.shape
    if tokens == 0:
        return probs.sum() * 0.0
    if counts is None:
        counts = count(experts.reshape(-1), num_experts)
    # E * sum_e (c_e / n) (S_e / T), S = probs.sum(0): one dot product (four ops forward, three backward).
    return torch.dot(probs.sum(0), counts.to(probs.dtype)) * (num_experts / (experts.numel() * tokens))


class Router(nn.Module):
    """x [tokens, hidden] -> Routing: a bias-free linear gate, softmax, top-k."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, normalize_top_k: bool = True) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.top_k, self.normalize_top_k = top_k, normalize_top_k

    def forward(self, x: torch.Tensor) -> Routing:
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # the upcast inside the softmax
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize_top_k and self.top_k > 1:
            # p_i / sum_topk p_j = exp(l_i) / sum_topk exp(l_j): the softmax of the chosen logits, two ops
            # forward and three backward where dividing by the sum takes two and seven.
            weights = torch.softmax(logits.gather(-1, experts), dim=-1, dtype=torch.float32)
        counts = count(experts.reshape(-1), probs.shape[-1])
        return Routing(weights.to(x.dtype), experts, probs, load_balancing_loss(probs, experts, counts), counts)
