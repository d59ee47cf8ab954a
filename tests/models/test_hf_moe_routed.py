"""`DispatchCombine`, the routing under a transformers model's experts, at every chunk schedule: equal to one process.

Each rank routes its own tokens (a given top-k choice and weight per token) to experts spread over
ep 2 and 3; the experts are any differentiable function (here tanh(x W_e)). The output, the
tokens' gradients, the routing weights' gradients and each rank's slice of the expert weights'
gradient (every rank's tokens summed) match one process within 1e-5, for chunks 1, 2, 3 and "ranks".
"""

import pytest

from distributed import distributed

TOL = 1e-5
EXPERTS, TOKENS, HIDDEN, TOP_K = 6, 7, 5, 2


def _data(rank: int):
    import torch

    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g, dtype=torch.float64)
    index = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(TOKENS)])
    weights = torch.rand(TOKENS, TOP_K, generator=g, dtype=torch.float64)
    probe = torch.randn(TOKENS, HIDDEN, generator=g, dtype=torch.float64)
    return x, index, weights, probe


def _experts(rows, expert, w):
    import torch

    return torch.tanh(torch.einsum("nh,nhk->nk", rows, w[expert]))


@distributed(world_size=2, timeout_s=180)  # the ranks' body; the test runs it at 2 and 3
def _routed(chunks_list):
    import torch
    import torch.distributed as dist

    from overlapkit.expert_parallel import DispatchCombine

    rank, world = dist.get_rank(), dist.get_world_size()
    full_w = torch.randn(EXPERTS, HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = {}
    for chunks in chunks_list:
        router = DispatchCombine(EXPERTS, dist.group.WORLD, chunks=chunks, name="t")
        w = full_w[router.local_experts].clone().requires_grad_(True)
        x, index, weights, probe = _data(rank)
        x.requires_grad_(True)
        weights.requires_grad_(True)
        y = router(x, index, weights, lambda rows, groups, ws: _experts(rows, groups.expert, ws[0]), [w])
        (y * probe).sum().backward()
        # one process: every rank's tokens, the whole experts
        ref_w = full_w.clone().requires_grad_(True)
        errs = {}
        for r in range(world):
            rx, ri, rw, rp = _data(r)
            rx.requires_grad_(True)
            rw.requires_grad_(True)
            per = torch.stack([_experts(rx, ri[:, j], ref_w) for j in range(TOP_K)], 1)
            ry = (per * rw.unsqueeze(-1)).sum(1)
            (ry * rp).sum().backward()
            if r == rank:
                errs["out"] = ((y - ry).norm() / ry.norm()).item()
                errs["dx"] = ((x.grad - rx.grad).norm() / rx.grad.norm()).item()
                errs["dweights"] = ((weights.grad - rw.grad).norm() / rw.grad.norm()).item()
        want = ref_w.grad[router.local_experts]
        errs["dW"] = ((w.grad - want).norm() / want.norm()).item()
        out[str(chunks)] = errs
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_every_schedule_equals_one_process(world):
    runner = distributed(world_size=world, timeout_s=180)(_routed.__wrapped__)
    for per in runner([1, 2, 3, "ranks"]):
        for chunks, errs in per.items():
            worst = max(errs, key=errs.get)
            assert errs[worst] <= TOL, (chunks, worst, errs[worst])
