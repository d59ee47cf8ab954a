"""`clip_grad_norm_(..., group=pp)`: each pipeline stage holds other parameters, and every stage clips by the
whole model's norm (as one process clipping all of them does), including a stage that holds no gradient."""

import pytest
import torch
import torch.distributed as dist

from distributed import distributed
from overlapkit.expert_parallel import clip_grad_norm_

SIZES = [(5, 3), (7,), (4, 4), (6,)]


def _grads() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=g) for s in SIZES]


def _params(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.zeros_like(x)) for x in grads]
    for p, x in zip(params, grads):
        p.grad = x.clone()
    return params


@distributed(world_size=3, timeout_s=60)
def _stages(norm_type: float) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    grads = _grads()
    mine = [i for i in range(len(grads)) if i % (world - 1) == rank]  # the last stage holds none
    params = _params([grads[i] for i in mine])
    total = clip_grad_norm_(params, 1.0, norm_type, group=dist.group.WORLD)
    return dict(total=total.item(), grads={i: p.grad for i, p in zip(mine, params)})


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_stages_clip_by_the_whole_models_norm(norm_type):
    ref = _params(_grads())
    want = torch.nn.utils.clip_grad_norm_(ref, 1.0, norm_type)
    got = _stages(norm_type)
    for r in got:
        assert abs(r["total"] - want.item()) <= 1e-5 * want.item(), (r["total"], want.item())
        for i, g in r["grads"].items():
            torch.testing.assert_close(g, ref[i].grad, rtol=1e-5, atol=1e-7)
    assert sorted(i for r in got for i in r["grads"]) == [0, 1, 2, 3]
