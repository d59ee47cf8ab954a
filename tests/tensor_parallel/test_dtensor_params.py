"""The TP layers' parameters are DTensors: meshes in, placements out, init like nn.Linear, DCP save/load/reshard.

DCP: saved at TP=2, loaded at TP=2, at TP=4 and into an unsharded model: every weight bit-equal
(DCP only copies bytes, so nothing may round). Full state dict: torch's get_model_state_dict with
full_state_dict=True, and load_state_dict of a full plain state dict.
"""

import torch
import torch.distributed as dist
from torch import nn

from distributed import distributed
from overlapkit.runtime.groups import ParallelGroups
from overlapkit.tensor_parallel import ColumnParallelLinear, RowParallelLinear


def _reference() -> nn.Sequential:
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 8))


def _tp_model(mesh_or_group, **kw) -> nn.Sequential:
    ref = _reference()
    return nn.Sequential(ColumnParallelLinear.from_full(ref[0], mesh_or_group, **kw), nn.GELU(),
                         RowParallelLinear.from_full(ref[2], mesh_or_group, **kw))


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _bit_equal(model, ref) -> bool:
    return all(torch.equal(_full(p), q) for p, q in zip(model.state_dict().values(), ref.state_dict().values()))


@distributed(world_size=2)
def _save_and_reload_tp2(path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    group, out = dist.group.WORLD, {}
    model = _tp_model(group)
    out["placements"] = [(k, type(v).__name__, tuple((type(p).__name__, getattr(p, "dim", None)) for p in v.placements))
                         for k, v in model.state_dict().items()]
    dcp.save(model.state_dict(), checkpoint_id=path)
    again = nn.Sequential(ColumnParallelLinear(8, 12, group), nn.GELU(), RowParallelLinear(12, 8, group))
    sd = again.state_dict()
    dcp.load(sd, checkpoint_id=path)  # in place, into the DTensors' local shards
    out["tp2 bit-equal"] = _bit_equal(again, _reference())
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    out["full_state_dict plain and equal"] = all(
        not hasattr(v, "placements") and torch.equal(v, r) for v, r in zip(full.values(), _reference().state_dict().values()))
    # A full plain state dict loads into a sharded model (each rank keeps its shard).
    fresh = nn.Sequential(ColumnParallelLinear(8, 12, group), nn.GELU(), RowParallelLinear(12, 8, group))
    fresh.load_state_dict(_reference().state_dict())
    out["load full plain"] = _bit_equal(fresh, _reference())
    try:
        fresh.load_state_dict({**_reference().state_dict(), "0.weight": torch.zeros(6, 8)})
        out["local-shaped plain"] = None
    except (ValueError, RuntimeError) as e:
        out["local-shaped plain"] = str(e)
    out["meta"] = _meta_init()  # in this world too: one spawn less
    return out


@distributed(world_size=4)
def _load_tp4_and_meshes(path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    out = {}
    model = nn.Sequential(ColumnParallelLinear(8, 12), nn.GELU(), RowParallelLinear(12, 8))  # None: the world
    dcp.load(model.state_dict(), checkpoint_id=path)
    out["tp4 bit-equal"] = _bit_equal(model, _reference())
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    layer = ColumnParallelLinear(8, 12, mesh)
    out["2-D mesh -> its tp dim"] = layer.weight.device_mesh == mesh["tp"] and layer.tp_size == 2
    groups = ParallelGroups.build(tp=2, dp=2)
    layer = RowParallelLinear(12, 8, groups)
    out["ParallelGroups -> mesh['tp']"] = layer.weight.device_mesh == groups.mesh["tp"]
    out["ProcessGroup -> 1-D mesh"] = ColumnParallelLinear(8, 12, groups.tp).weight.device_mesh.size() == 2
    try:
        ColumnParallelLinear(8, 12, init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)))
        out["no tp dim"] = None
    except ValueError as e:
        out["no tp dim"] = str(e)
    wrong = DTensor.from_local(torch.zeros(4), mesh["dp"], [Replicate()], run_check=False)
    try:
        RowParallelLinear(12, 4, mesh).load_state_dict({"weight": torch.zeros(4, 12), "bias": wrong})
        out["wrong mesh"] = None
    except ValueError as e:
        out["wrong mesh"] = str(e)
    return out


@distributed(world_size=1)
def _load_unsharded(path):
    import torch.distributed.checkpoint as dcp

    plain = nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 8))
    sd = plain.state_dict()
    dcp.load(sd, checkpoint_id=path)
    return all(torch.equal(a, b) for a, b in zip(sd.values(), _reference().state_dict().values()))


def test_dcp_saves_at_tp2_and_loads_at_tp2_tp4_and_unsharded_and_meta_init(tmp_path):
    path = str(tmp_path / "ckpt")
    for out in _save_and_reload_tp2(path):
        assert out["placements"] == [("0.weight", "DTensor", (("Shard", 0),)), ("0.bias", "DTensor", (("Shard", 0),)),
                                     ("2.weight", "DTensor", (("Shard", 1),)), ("2.bias", "DTensor", (("Replicate", None),))]
        assert out["tp2 bit-equal"] and out["full_state_dict plain and equal"] and out["load full plain"]
        assert "must be the full (unsharded) parameter of shape (12, 8)" in out["local-shaped plain"]
        # Meta init: to_empty + reset_parameters (seeded like nn.Linear) gives nn.Linear's parameters.
        for name, r in out["meta"].items():
            assert r["eager"] and r["meta"], (name, r)
            assert r["dtensor_after_to_empty"] == "DTensor"
            assert "materialize them with to_empty" in r["refused"]
    for out in _load_tp4_and_meshes(path):
        assert out["tp4 bit-equal"]
        assert out["2-D mesh -> its tp dim"] and out["ParallelGroups -> mesh['tp']"] and out["ProcessGroup -> 1-D mesh"]
        assert "('dp',)" in out["no tp dim"] and "'tp'" in out["no tp dim"]
        assert "is a DTensor on DeviceMesh" in out["wrong mesh"] and "dp" in out["wrong mesh"]
    assert _load_unsharded(path) == [True]


def _meta_init():
    group, out = dist.group.WORLD, {}
    for Layer, (fin, fout) in ((ColumnParallelLinear, (6, 4)), (RowParallelLinear, (4, 6))):
        torch.manual_seed(5)
        ref = nn.Linear(fin, fout)
        torch.manual_seed(5)
        eager = Layer(fin, fout, group)  # built on CPU: nn.Linear's init of the full weight, sharded
        meta = Layer(fin, fout, group, device="meta")
        try:
            meta.reset_parameters()
            refused = None
        except RuntimeError as e:
            refused = str(e)
        meta.to_empty(device="cpu")
        torch.manual_seed(5)
        meta.reset_parameters()
        out[Layer.__name__] = dict(
            eager=torch.equal(eager.weight.full_tensor(), ref.weight) and torch.equal(eager.bias.full_tensor(), ref.bias),
            meta=torch.equal(meta.weight.full_tensor(), ref.weight) and torch.equal(meta.bias.full_tensor(), ref.bias),
            dtensor_after_to_empty=type(meta.weight).__name__, refused=refused)
    return out


@distributed(world_size=2)
def _grads_are_dtensors():
    """Gradients of the TP layers' parameters arrive as DTensors of the parameters' mesh and placements.

    FSDP2, DCP and the optimizers read them that way; the layers build them from the
    parameters' cached spec in their own backward (no to_local/from_local pair).
    """
    group, r = dist.group.WORLD, dist.get_rank()
    torch.manual_seed(7)
    x = torch.randn(8, 8)
    ref = _reference()
    ref(x).sum().backward()
    out = {}
    for mode in ("none", "bulk", "pipelined"):
        for autocast in (False, True):
            model = _tp_model(group, sequence_parallel=True, overlap=mode)
            xs = x.chunk(2)[r].clone().requires_grad_(True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = model(xs)
            y.float().sum().backward()
            kinds, err = [], 0.0
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                g = p.grad
                kinds.append((name, type(g).__name__, g.device_mesh == p.device_mesh,
                              tuple(g.placements) == tuple(p.placements), g.dtype == p.dtype,
                              tuple(g.shape) == tuple(p.shape)))
                if not autocast and name.endswith("weight"):  # row bias: summed over the SP ranks elsewhere
                    err = max(err, ((g.full_tensor() - q.grad).norm() / q.grad.norm()).item())
            out[(mode, autocast)] = (kinds, err, xs.grad is not None and xs.grad.dtype == xs.dtype)
    return out


def test_gradients_are_dtensors_with_the_parameters_placements():
    for rank, res in enumerate(_grads_are_dtensors()):
        for (mode, autocast), (kinds, err, xgrad_ok) in res.items():
            for name, kind, same_mesh, same_placements, same_dtype, same_shape in kinds:
                assert (kind, same_mesh, same_placements, same_dtype, same_shape) == ("DTensor", True, True, True, True), \
                    f"rank {rank} {mode} autocast={autocast} {name}: {kind} mesh={same_mesh} " \
                    f"placements={same_placements} dtype={same_dtype} shape={same_shape}"
            assert err <= 1e-5, f"rank {rank} {mode}: weight gradient rel err {err:.2e}"
            assert xgrad_ok, f"rank {rank} {mode} autocast={autocast}: input gradient missing or of another dtype"
