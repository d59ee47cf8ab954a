"""ShardedOptimizer under torch.distributed.checkpoint: its per-parameter state saved at dp=2 loads
bit-equal at dp=2 (and the next steps equal a never-checkpointed run), at dp=3, and into a plain
single-process torch optimizer; a plain torch optimizer's checkpoint loads into it; with TP layers
(saved at dp=2 x tp=2; loaded there, at dp=4 and at tp=4) too. The old per-rank state_dict() through DCP fails loudly, never loads wrong."""

import functools
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distributed import distributed
from overlapkit.data_parallel import DataParallel, ShardedOptimizer

# DCP in the test process itself (no torch.distributed there) says so each time
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

KW = dict(lr=2e-2, weight_decay=0.1)
# ~25 and ~100 fp32 values: several buckets, parameters cut across the ranks' shards
BUCKETS = dict(first_bucket_mb=100 / 2**20, bucket_mb=400 / 2**20)


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 5))


def _tp_mlp(groups, seed: int = 0) -> nn.Sequential:
    from overlapkit.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    ref = _mlp(seed)
    return nn.Sequential(ref[0], ColumnParallelLinear.from_full(ref[1], groups), nn.GELU(),
                         RowParallelLinear.from_full(ref[3], groups))


def _batch(step: int, rank: int = 0, world: int = 1):
    gen = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(6, 6, generator=gen), torch.randn(6, 5, generator=gen)
    rows = slice(rank * 6 // world, (rank + 1) * 6 // world)
    return x[rows], y[rows]


def _train(model, opt, steps, rank=0, world=1, inputs=None):
    for step in steps:
        opt.zero_grad()
        x, y = _batch(step, rank, world)
        out = model(x if inputs is None else inputs(x))
        F.mse_loss(out, y if inputs is None else inputs(y)).backward()
        opt.step()
    if isinstance(opt, ShardedOptimizer):
        opt.finish_param_gather()  # the last step's gathers may still be landing in the parameters


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _full_state(osd: dict) -> dict:
    return {fqn: {k: _full(v).clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for fqn, s in osd["state"].items()}


def _sharded(model_fn, group):
    m = DataParallel(model_fn(), group, **BUCKETS)
    return m, ShardedOptimizer(m, torch.optim.AdamW, group, **KW)


def _load(m, opt, path, group=None, no_dist=False):
    import torch.distributed.checkpoint as dcp

    sd = {"model": m.module.state_dict(), "optim": opt.checkpoint_state_dict()}
    dcp.load(sd, checkpoint_id=path, process_group=group, no_dist=no_dist)  # the model in place, into its parameters
    opt.load_checkpoint_state_dict(sd["optim"])


def _params_equal(a: DataParallel, b: DataParallel) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.module.parameters(), b.module.parameters()))


def _inner_state_equal(a: ShardedOptimizer, b: ShardedOptimizer) -> bool:
    return all(torch.equal(x, y) for ma, mb in zip(a.master, b.master)
               for x, y in zip([ma, *a.optimizer.state[ma].values()], [mb, *b.optimizer.state[mb].values()]))


def _dp2(root, group, rank):
    import torch.distributed.checkpoint as dcp

    out = {}
    m, opt = _sharded(_mlp, group)
    _train(m, opt, range(2), rank, 2)
    osd = opt.checkpoint_state_dict()
    out["kinds"] = sorted({(k, type(v).__name__, str(getattr(v, "placements", ""))) for s in osd["state"].values()
                           for k, v in s.items()})
    out["param_groups"] = osd["param_groups"]
    dcp.save({"model": m.module.state_dict(), "optim": osd}, checkpoint_id=f"{root}/dp2", process_group=group)
    out["state"] = _full_state(osd)
    # reload at dp=2 into a model and optimizer built from other weights, never stepped
    m2, opt2 = _sharded(lambda: _mlp(seed=9), group)
    _load(m2, opt2, f"{root}/dp2", group)
    out["dp2 state bit-equal"] = _inner_state_equal(opt, opt2)
    _train(m, opt, range(2, 4), rank, 2)
    _train(m2, opt2, range(2, 4), rank, 2)
    out["dp2 next steps bit-equal"] = _params_equal(m, m2)
    out["params after 4 steps"] = [p.detach().clone() for p in m.module.parameters()]
    # the old per-rank format through DCP: DCP keeps one rank's plain shard (and "rank") for everyone
    m3, opt3 = _sharded(_mlp, group)
    _train(m3, opt3, range(1), rank, 2)
    dcp.save({"optim": opt3.state_dict()}, checkpoint_id=f"{root}/old", process_group=group)
    old = opt3.state_dict()
    dcp.load({"optim": old}, checkpoint_id=f"{root}/old", process_group=group)
    try:
        opt3.load_state_dict(old)
        out["old format"] = None
    except ValueError as e:
        out["old format"] = str(e)
    return out


def _dp3(root, group, rank):
    out = {}
    m, opt = _sharded(lambda: _mlp(seed=9), group)
    _load(m, opt, f"{root}/dp2", group)
    out["state"] = _full_state(opt.checkpoint_state_dict())
    _train(m, opt, range(2, 4), rank, 3)
    out["params after 4 steps"] = [p.detach().clone() for p in m.module.parameters()]
    m, opt = _sharded(lambda: _mlp(seed=9), group)
    _load(m, opt, f"{root}/plain", group)  # a single-process torch optimizer's checkpoint
    out["from plain"] = _full_state(opt.checkpoint_state_dict())
    try:
        opt.load_checkpoint_state_dict({"state": {}, "param_groups": [dict(KW, params=[])]})
        out["missing"] = None
    except ValueError as e:
        out["missing"] = str(e)
    return out


def _tp(root, rank):
    """dp=2 x tp=2: TP states are DTensors on the TP mesh; reload there, at dp=4 without TP, at tp=4."""
    import torch.distributed.checkpoint as dcp

    from overlapkit.runtime.groups import ParallelGroups

    groups, out = ParallelGroups.build(tp=2, dp=2), {}
    dp_rank = groups.dp_rank

    def sharded(seed):
        m = DataParallel(_tp_mlp(groups, seed), groups, **BUCKETS)
        return m, ShardedOptimizer(m, torch.optim.AdamW, groups, **KW)

    m, opt = sharded(0)
    _train(m, opt, range(2), dp_rank, 2)
    osd = opt.checkpoint_state_dict()
    out["placements"] = {f: str(osd["state"][f]["exp_avg"].placements) for f in ("1.weight", "3.weight", "0.weight")}
    dcp.save({"model": m.module.state_dict(), "optim": osd}, checkpoint_id=f"{root}/tp")
    out["state"] = _full_state(osd)
    out["params"] = {k: _full(v).clone() for k, v in m.module.state_dict().items()}
    m2, opt2 = sharded(9)
    _load(m2, opt2, f"{root}/tp")
    out["tp state bit-equal"] = _inner_state_equal(opt, opt2)
    _train(m, opt, range(2, 3), dp_rank, 2)
    _train(m2, opt2, range(2, 3), dp_rank, 2)
    out["tp next step bit-equal"] = _params_equal(m, m2)
    m4, opt4 = _sharded(lambda: _mlp(seed=9), dist.group.WORLD)  # dp=4, no TP
    _load(m4, opt4, f"{root}/tp", dist.group.WORLD)
    out["dp4 state"] = _full_state(opt4.checkpoint_state_dict())
    tp4 = ParallelGroups.build(tp=4, dp=1)
    m4 = DataParallel(_tp_mlp(tp4, 9), tp4, **BUCKETS)
    opt4 = ShardedOptimizer(m4, torch.optim.AdamW, tp4, **KW)
    _load(m4, opt4, f"{root}/tp")
    out["tp4 state"] = _full_state(opt4.checkpoint_state_dict())
    return out


@distributed(world_size=4, timeout_s=120.0)
def _four_ranks(root):
    rank = dist.get_rank()
    pair, three = dist.new_group([0, 1]), dist.new_group([0, 1, 2])  # every rank creates every group
    out = {}
    if rank < 2:
        out["dp2"] = _dp2(root, pair, rank)
    dist.barrier()
    if rank < 3:
        out["dp3"] = _dp3(root, three, rank)
    dist.barrier()
    out["tp"] = _tp(root, rank)
    return out


def _plain_into_torch(path, model):
    """The conversion path: a ShardedOptimizer checkpoint into a plain torch optimizer, one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    opt = torch.optim.AdamW(model.parameters(), **KW)
    sd = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=path, no_dist=True)
    set_optimizer_state_dict(model, opt, sd["optim"])
    return opt


def _same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[f].keys() == b[f].keys() and all(torch.equal(a[f][k], b[f][k]) for k in a[f]) for f in a)


@functools.cache
def _results():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    root, out = tempfile.mkdtemp(prefix="zero_dcp_"), {}
    plain = _mlp(seed=3)
    plain_opt = torch.optim.AdamW(plain.parameters(), **KW)
    _train(plain, plain_opt, range(2))
    out["plain state"] = _full_state(get_optimizer_state_dict(plain, plain_opt))
    dcp.save({"model": plain.state_dict(), "optim": get_optimizer_state_dict(plain, plain_opt)},
             checkpoint_id=f"{root}/plain", no_dist=True)
    ranks = _four_ranks(root)
    out["dp2"], out["dp3"], out["tp"] = ranks[0]["dp2"], [r["dp3"] for r in ranks[:3]], [r["tp"] for r in ranks]
    out["dp2 ranks"] = [r["dp2"] for r in ranks[:2]]
    for name in ("dp2", "tp"):
        model = _mlp(seed=9)
        opt = _plain_into_torch(f"{root}/{name}", model)
        out[f"torch state from {name}"] = _full_state(get_optimizer_state_dict(model, opt))
        out[f"torch params from {name}"] = {k: v.clone() for k, v in model.state_dict().items()}
        if name == "dp2":
            _train(model, opt, range(2, 4))
            out["torch params after 4 steps"] = [p.detach().clone() for p in model.parameters()]
    return out


def test_dp2_round_trip_is_bit_equal_and_steps_on_as_if_never_saved():
    for r in _results()["dp2 ranks"]:
        assert r["dp2 state bit-equal"] and r["dp2 next steps bit-equal"], r
        assert r["param_groups"][0]["params"] == ["0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"]
        assert r["param_groups"][0]["lr"] == KW["lr"]
        assert ("exp_avg", "DTensor", "(Shard(dim=0),)") in r["kinds"] and ("step", "Tensor", "") in r["kinds"], r


def test_dp3_loads_the_same_state_and_steps_on():
    res = _results()
    for r in res["dp3"]:
        assert _same_state(r["state"], res["dp2"]["state"])
        for p, q in zip(r["params after 4 steps"], res["dp2"]["params after 4 steps"]):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_conversion_into_a_plain_torch_optimizer_and_back():
    res = _results()
    assert _same_state(res["torch state from dp2"], res["dp2"]["state"])
    for p, q in zip(res["torch params after 4 steps"], res["dp2"]["params after 4 steps"]):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    for r in res["dp3"]:
        assert _same_state(r["from plain"], res["plain state"])


def test_with_tp_layers():
    res = _results()
    for r in res["tp"]:
        assert r["tp state bit-equal"] and r["tp next step bit-equal"], r
        assert r["placements"] == {"1.weight": "(Shard(dim=0),)", "3.weight": "(Shard(dim=1),)",
                                   "0.weight": "(Shard(dim=0),)"}, r  # 0 (LayerNorm): Shard(0) on dp
        assert _same_state(r["state"], res["tp"][0]["state"]) and _same_state(r["dp4 state"], r["state"])
        assert _same_state(r["tp4 state"], r["state"])
    assert _same_state(res["torch state from tp"], res["tp"][0]["state"])
    for k, v in res["tp"][0]["params"].items():
        assert torch.equal(res["torch params from tp"][k], v), k


def test_old_format_through_dcp_fails_on_every_rank():
    olds = [r["old format"] for r in _results()["dp2 ranks"]]
    assert all(olds) and any("does not fit this layout: rank=" in e for e in olds), olds
    for r in _results()["dp3"]:
        assert "no state for parameters ['0.weight'" in r["missing"], r


def test_world_of_one_bf16_masters_and_a_model_loaded_after_the_optimizer():
    import torch.distributed.checkpoint as dcp

    root = tempfile.mkdtemp(prefix="zero_dcp1_")
    for dtype in (torch.float32, torch.bfloat16):
        m, opt = _sharded(lambda: _mlp().to(dtype), None)  # no torch.distributed: a world of one
        _train(m, opt, range(2), inputs=lambda t: t.to(dtype))
        osd = opt.checkpoint_state_dict()
        fp32 = dtype == torch.float32
        assert ("master" in osd["state"]["1.weight"]) != fp32  # bf16 keeps its fp32 master, fp32 is its own
        assert all(not hasattr(v, "placements") for s in osd["state"].values() for v in s.values())
        dcp.save({"model": m.module.state_dict(), "optim": osd}, checkpoint_id=f"{root}/{dtype}", no_dist=True)
        m2, opt2 = _sharded(lambda: _mlp(seed=9).to(dtype), None)
        _load(m2, opt2, f"{root}/{dtype}", no_dist=True)
        assert _inner_state_equal(opt, opt2), dtype
        # weights written after the optimizer was built (load_state_dict, an in-place DCP load) are
        # what the next step starts from: at lr 0 they stay, never the optimizer's older copy
        other = _mlp(seed=5).to(dtype).state_dict()
        m2.module.load_state_dict(other)
        opt2.param_groups[0]["lr"] = 0.0
        _train(m2, opt2, range(2, 3), inputs=lambda t: t.to(dtype))
        for k, v in m2.module.state_dict().items():
            assert torch.equal(v, other[k]), (dtype, k)
    # built from parameters, not a DataParallel: named params[i]
    model = _mlp()
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, None, overlap_param_gather=False, **KW)
    _train(model, opt, range(1))
    osd = opt.checkpoint_state_dict()
    assert osd["param_groups"][0]["params"] == [f"params[{i}]" for i in range(6)]
    assert osd["state"]["params[2]"]["exp_avg"].shape == (12, 6)
    torch.testing.assert_close(osd["state"]["params[2]"]["exp_avg"], (1 - 0.9) * model[1].weight.grad)
