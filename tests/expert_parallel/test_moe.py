"""The EP MoE equals a plain single-process MoE: output, input grad, router grad, every expert grad.

One spawned world per world size (worlds.py) runs every case (top-1/2, uniform/skewed routing,
chunks 1-4 and by source rank, ranks with few or zero tokens, a capacity factor with exact split sizes and padded to
the capacity, which needs the same number of tokens on every rank).
"""

import math

import pytest
import torch
import torch.distributed as dist

from overlapkit.expert_parallel import MoE, init_full_experts
from reference import reference_moe
from worlds import world

H, F, AUX = 8, 12, 0.1
TOKENS = [6, 2, 0, 9]  # rank 1 has fewer tokens than chunks; rank 2 none at all
EQUAL_TOKENS = [7] * 4  # the padded path's split sizes come from the token count: the same on every rank


def _rel(a, b) -> float:
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-6) if b.numel() else 0.0


def _inputs(ws: int, experts: int, skew: bool, seed: int, tokens=TOKENS):
    g = torch.Generator().manual_seed(seed)
    d = torch.nn.functional.normalize(torch.randn(H, generator=g), dim=0)
    xs = [torch.randn(tokens[r % 4], H, generator=g) for r in range(ws)]
    grads = [torch.randn(tokens[r % 4], H, generator=g) for r in range(ws)]
    gate = torch.randn(experts, H, generator=g) * 0.3
    if skew:  # expert 0 takes most tokens, the last expert none
        xs = [x * 0.3 + d for x in xs]
        gate[0], gate[-1] = 4 * d, -4 * d
    return xs, grads, gate


def _case(experts: int, top_k: int, chunks: int, skew: bool, capacity_factor=None, seed=0, pad=None) -> dict:
    ws, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(seed)
    moe = MoE(H, F, experts, top_k, dist.group.WORLD, chunks=chunks, capacity_factor=capacity_factor,
              pad_to_capacity=pad)
    xs, grads, gate = _inputs(ws, experts, skew, seed, EQUAL_TOKENS if pad else TOKENS)
    with torch.no_grad():
        moe.router.gate.weight.copy_(gate)
    full = init_full_experts(experts, H, F, torch.Generator().manual_seed(seed + 1))
    moe.load_full(*full)
    x = xs[rank].clone().requires_grad_()
    out = moe(x)
    ((out * grads[rank]).sum() + AUX * moe.aux_loss).backward()

    ref_params = [p.clone().requires_grad_() for p in (gate, *full)]
    ref_x = [xr.clone().requires_grad_() for xr in xs]
    loss, dropped = 0.0, 0
    for r in range(ws):  # the sum of every rank's loss, as the parallel run's gradients are
        o, aux, drop = reference_moe(ref_x[r], *ref_params, top_k, True, capacity_factor)
        loss = loss + (o * grads[r]).sum() + AUX * aux
        dropped += drop
        if r == rank:
            ref_out, ref_aux = o.detach(), aux.detach()
    loss.backward()
    router_grad = moe.router.gate.weight.grad.clone()
    dist.all_reduce(router_grad)  # each rank's router grad covers its own tokens
    e = moe.experts
    errs = {"out": _rel(out, ref_out), "aux": _rel(moe.aux_loss, ref_aux), "dx": _rel(x.grad, ref_x[rank].grad),
            "router": _rel(router_grad, ref_params[0].grad)}
    for name, p, ref in zip(("w1", "b1", "w2", "b2"), (e.w1, e.b1, e.w2, e.b2), ref_params[1:]):
        errs[name] = _rel(p.grad, moe.shard_of(ref.grad, name))
    load = moe.last_load
    counts = torch.tensor(load.sent_per_expert)
    dist.all_reduce(counts)
    mine_dropped = torch.tensor(load.dropped)
    dist.all_reduce(mine_dropped)
    return dict(err=max(errs.values()), errs=errs, per_expert=counts.tolist(), dropped=(mine_dropped.item(), dropped))


def _all_cases() -> dict:
    ws = dist.get_world_size()
    experts = 2 * ws
    out = {}
    for top_k in (1, 2):
        for skew in (False, True):
            for chunks in (1, 2, 3, 4, "ranks"):
                out[(top_k, skew, chunks, None)] = _case(experts, top_k, chunks, skew)
    out[(2, True, 3, 1.0)] = _case(experts, 2, 3, True, capacity_factor=1.0)
    out[(1, False, 2, 0.5)] = _case(experts, 1, 2, False, capacity_factor=0.5)
    out[(2, True, "ranks", 1.0)] = _case(experts, 2, "ranks", True, capacity_factor=1.0)
    for top_k, skew, chunks, cf in ((2, True, 3, 1.0), (1, False, 2, 0.5), (2, False, 1, 1.5), (2, True, 4, 0.6),
                                    (2, True, "ranks", 1.0), (1, False, "ranks", 0.5)):
        out[(top_k, skew, chunks, f"{cf} padded")] = _case(experts, top_k, chunks, skew, capacity_factor=cf, pad=True)
    return out


@pytest.mark.parametrize("size", [2, 3, 4], ids=["ep2", "ep3", "ep4"])
def test_moe_matches_single_process(size):
    for rank in world(size):
        for (top_k, skew, chunks, cf), r in rank["cases"].items():
            assert r["err"] <= 1e-5, ((top_k, skew, chunks, cf), r["errs"])
            assert r["dropped"][0] == r["dropped"][1], "dropped assignments are counted, as the reference drops them"
            if skew and cf is None:  # the case tests what it says: one expert most, one none
                counts = r["per_expert"]
                assert counts[-1] == 0 and counts[0] > sum(counts) / top_k / 2, counts
            if cf in (1.0, "1.0 padded"):
                assert r["dropped"][0] > 0, "the skewed capacity case must drop something"
