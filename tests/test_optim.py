"""optim_param_groups: torch's foreach / fused optimizer kernels over a TP model (DTensor and plain
parameters) run, and give what the per-tensor kernels give; options and order are kept."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed import distributed
from overlapkit import optim_param_groups


def _tp_model():
    from overlapkit.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(3)
    ref = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 8))
    group = dist.group.WORLD
    return nn.Sequential(ref[0], ColumnParallelLinear.from_full(ref[1], group), nn.GELU(),
                         RowParallelLinear.from_full(ref[3], group))


def _train(opt_kwargs: dict, grouped: bool) -> list[torch.Tensor]:
    model = _tp_model()
    params = optim_param_groups(model) if grouped else model.parameters()
    opt = torch.optim.AdamW(params, lr=0.05, weight_decay=0.1, **opt_kwargs)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
        opt.step()
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]


@distributed(world_size=2, timeout_s=60.0)
def _tp_cases():
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    try:
        _train({"foreach": True}, grouped=False)
        out["mixed foreach"] = None
    except RuntimeError as e:
        out["mixed foreach"] = str(e)
    reference = _train({"foreach": False}, grouped=False)
    for name, kw in (("foreach", {"foreach": True}), ("fused", {"fused": True})):
        got = _train(kw, grouped=True)
        out[name] = max((a - b).abs().max().item() for a, b in zip(got, reference))
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = _tp_model()
    opt = torch.optim.AdamW(optim_param_groups(model), lr=0.1, foreach=True)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    # the optimizer state of a TP weight is a DTensor like the weight, so DCP reshards it
    osd = get_optimizer_state_dict(model, opt)["state"]
    out["state kinds"] = {k: str(getattr(osd[k]["exp_avg"], "placements", "plain")) for k in ("0.weight", "1.weight")}
    groups = optim_param_groups(model, lr=0.1)
    out["group kinds"] = [(type(g["params"][0]).__name__, len(g["params"]), g["lr"]) for g in groups]
    a = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    b = init_device_mesh("cpu", (2,), mesh_dim_names=("other",))
    from torch.distributed.tensor import DTensor, Replicate
    ps = [DTensor.from_local(torch.zeros(2), m, [Replicate()]) for m in (a, b, a)]
    out["two meshes"] = [[next(i for i, q in enumerate(ps) if q is p) for p in g["params"]]
                         for g in optim_param_groups(ps)]
    return out


def test_foreach_and_fused_over_a_tp_model():
    for r in _tp_cases():
        # torch's limit this module exists for: if this stops failing, optim_param_groups is no longer needed
        assert r["mixed foreach"] and "mixed torch.Tensor and DTensor" in r["mixed foreach"], r
        assert r["foreach"] <= 1e-6 and r["fused"] <= 1e-6, r
        # LayerNorm (2 plain) first, then the 4 DTensors of the TP layers on one mesh
        assert r["group kinds"] == [("Parameter", 2, 0.1), ("DTensor", 4, 0.1)], r
        assert r["two meshes"] == [[0, 2], [1]], r
        assert r["state kinds"] == {"0.weight": "plain", "1.weight": "(Shard(dim=0),)"}, r


def test_options_and_order_are_kept():
    a, b, c = (nn.Parameter(torch.zeros(2)) for _ in range(3))
    groups = optim_param_groups([{"params": [a, b], "weight_decay": 0.0}, {"params": c}], lr=0.1, weight_decay=0.5)
    assert [g["params"] for g in groups] == [[a, b], [c]]
    assert [(g["lr"], g["weight_decay"]) for g in groups] == [(0.1, 0.0), (0.1, 0.5)]
    model = nn.Linear(3, 2)
    (only,) = optim_param_groups(model, betas=(0.8, 0.9))
    assert only["params"] == list(model.parameters()) and only["betas"] == (0.8, 0.9)
    torch.optim.AdamW(optim_param_groups(model), lr=0.1, foreach=True).step()  # plain only: one group


def test_bad_input():
    p = nn.Parameter(torch.zeros(2))
    with pytest.raises(TypeError, match="not a single tensor"):
        optim_param_groups(p)
    with pytest.raises(ValueError, match="got no parameters"):
        optim_param_groups([])
    with pytest.raises(TypeError, match="mixes param groups"):
        optim_param_groups([p, {"params": [p]}])
    with pytest.raises(ValueError, match="param group 0 has no 'params' key"):
        optim_param_groups([{"lr": 1.0}])
    with pytest.raises(TypeError, match="holds a int"):
        optim_param_groups([{"params": [p, 3]}])
