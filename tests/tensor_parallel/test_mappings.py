"""Each conjugate op: forward and backward against what the full tensor says they must be."""

import torch
import torch.distributed as dist

from distributed import distributed
from overlapkit.tensor_parallel import mappings as m
from overlapkit.timeline import record


def _check_all(ws: int, r: int):
    g = dist.group.WORLD
    torch.manual_seed(0)
    X = torch.randn(ws, 2 * ws, 3, 2 * ws)  # per-rank inputs X[r], same everywhere
    G = torch.randn(ws, 2 * ws, 3, 2 * ws)  # per-rank output grads G[r]
    out = {}

    def run(op, x, grad):
        x = x.clone().requires_grad_(True)
        y = op(x, g)
        y.backward(grad)
        return y.detach(), x.grad

    y, dx = run(m.copy_to_tp, X[r], G[r])
    out["copy"] = (torch.equal(y, X[r]), torch.allclose(dx, G.sum(0)))
    y, dx = run(m.reduce_from_tp, X[r], G[0])
    out["reduce"] = (torch.allclose(y, X.sum(0)), torch.equal(dx, G[0]))
    y, dx = run(m.scatter_to_sp, X[0], G[r].chunk(ws, 0)[r])
    out["scatter_sp"] = (torch.equal(y, X[0].chunk(ws, 0)[r]),
                         torch.equal(dx, torch.cat([G[k].chunk(ws, 0)[k] for k in range(ws)])))
    y, dx = run(m.gather_from_sp, X[r], G[r].repeat(ws, 1, 1)[: 2 * ws * ws])
    full_g = torch.stack([G[k].repeat(ws, 1, 1)[: 2 * ws * ws] for k in range(ws)]).sum(0)
    out["gather_sp"] = (torch.equal(y, torch.cat(list(X))), torch.allclose(dx, full_g.chunk(ws, 0)[r]))
    y, dx = run(m.reduce_scatter_to_sp, X[r], G[r].chunk(ws, 0)[0])
    out["reduce_scatter_sp"] = (torch.allclose(y, X.sum(0).chunk(ws, 0)[r]),
                                torch.equal(dx, torch.cat([G[k].chunk(ws, 0)[0] for k in range(ws)])))
    y, dx = run(m.gather_from_tp, X[r], G[0].repeat(1, 1, ws))
    out["gather_tp"] = (torch.equal(y, torch.cat(list(X), -1)), torch.equal(dx, G[0]))
    y, dx = run(m.scatter_to_tp, X[0], G[r].chunk(ws, -1)[r])
    out["scatter_tp"] = (torch.equal(y, X[0].chunk(ws, -1)[r]),
                         torch.equal(dx, torch.cat([G[k].chunk(ws, -1)[k] for k in range(ws)], -1)))
    return out


@distributed(world_size=3)
def _ops3():
    return _check_all(3, dist.get_rank())


def test_conjugate_ops_forward_and_backward_ws3():
    for rank_out in _ops3():
        for name, (fwd_ok, bwd_ok) in rank_out.items():
            assert fwd_ok, f"{name} forward"
            assert bwd_ok, f"{name} backward"


@distributed(world_size=2)
def _mirror():
    g = dist.group.WORLD
    x = torch.randn(4, 3, requires_grad=True)
    with record() as rec:
        y = m.gather_from_sp(x, g, name="layer")
        y.sum().backward()
        z = m.reduce_scatter_to_sp(x * 1, g, name="rs")
        z.sum().backward()
    return [(s.name, s.kind) for s in rec.spans]


def test_backward_mirrors_forward_on_the_timeline():
    spans = _mirror()[0]
    assert ("layer.fwd", "tp_all_gather") in spans and ("layer.bwd", "tp_reduce_scatter") in spans
    assert ("rs.fwd", "tp_reduce_scatter") in spans and ("rs.bwd", "tp_all_gather") in spans
