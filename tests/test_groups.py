import pytest
import torch.distributed as dist

from distributed import distributed
from overlapkit.runtime.groups import ParallelGroups, ParallelSizes


def test_layout_tp_adjacent():
    s = ParallelSizes(tp=2, dp=3, pp=2)
    assert s.world_size == 12
    assert s.tp_groups()[0] == [0, 1]
    assert s.dp_groups()[0] == [0, 2, 4]
    assert s.pp_groups()[0] == [0, 6]
    assert s.coords(7) == (1, 0, 1, 0)
    for r in range(12):
        assert s.rank_of(*s.coords(r)) == r
    # every rank is in exactly one group of each kind
    for groups in (s.tp_groups(), s.dp_groups(), s.pp_groups()):
        assert sorted(r for g in groups for r in g) == list(range(12))


def test_ep_carved_from_dp():
    s = ParallelSizes(tp=1, dp=4, ep=2)
    assert s.ep_groups() == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="ep=3 must divide dp=4"):
        ParallelSizes(dp=4, ep=3)


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_sizes_must_be_positive_ints(bad):
    with pytest.raises(ValueError, match="ParallelSizes.tp"):
        ParallelSizes(tp=bad)


def test_world_mismatch_names_sizes():
    with pytest.raises(ValueError, match=r"pp=1 x dp=2 x cp=1 x tp=2 = 4 does not equal the world size 3"):
        ParallelSizes(tp=2, dp=2).check_world(3)


@distributed(world_size=4)
def _build_groups():
    g = ParallelGroups.build(tp=2)
    members = {}
    for name in ("tp", "dp", "pp"):
        members[name] = sorted(dist.get_process_group_ranks(getattr(g, name)))
    try:
        ParallelGroups.build(tp=3)
        err = None
    except ValueError as e:
        err = str(e)
    return g.tp_rank, g.dp_rank, members, err


def test_build_on_four_ranks():
    out = _build_groups()
    assert [o[0] for o in out] == [0, 1, 0, 1]
    assert [o[1] for o in out] == [0, 0, 1, 1]
    assert out[0][2]["tp"] == [0, 1] and out[3][2]["tp"] == [2, 3]
    assert out[0][2]["dp"] == [0, 2] and out[1][2]["dp"] == [1, 3]
    # bad sizes raise the same message on every rank, before any collective
    assert all(o[3] == "tp=3 x cp=1 x pp=1 = 3 does not divide the world size 4" for o in out)


def test_cp_sits_between_dp_and_tp():
    s = ParallelSizes(tp=2, cp=2, dp=2)
    assert s.cp_groups()[0] == [0, 2]
    assert s.dp_groups()[0] == [0, 4]
    assert s.coords(6) == (0, 1, 0, 1)
    for r in range(s.world_size):
        assert s.rank_of(*s.coords(r)) == r


@distributed(world_size=4, timeout_s=30)
def _mesh_view():
    import overlapkit
    from overlapkit.runtime.groups import group_timeout_s, resolve_group

    g = overlapkit.init(tp=2, timeout_s=7)
    out = {
        "dims": g.mesh.mesh_dim_names, "shape": tuple(g.mesh.shape),
        "tp_is_mesh_tp": g.mesh["tp"].get_group() is g.tp,
        "tp_ranks": dist.get_process_group_ranks(resolve_group(g.mesh["tp"])),
        "dp_ranks": dist.get_process_group_ranks(resolve_group(g.mesh, "dp")),
        "via_groups": resolve_group(g, "dp") is g.dp,
        "timeouts": [group_timeout_s(x) for x in (g.tp, g.dp, g.pp, g.cp, g.ep)],
        "world": resolve_group(None) is dist.group.WORLD,
    }
    try:
        resolve_group(g.mesh, "ep")
    except ValueError as e:
        out["no_dim"] = str(e)
    # A user's own mesh, dims in another order than ours: coordinates come from the mesh.
    from torch.distributed.device_mesh import init_device_mesh
    user = overlapkit.init(mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp")))
    out["user_coords"] = (user.tp_rank, user.dp_rank)
    out["user_tp"] = dist.get_process_group_ranks(user.tp)
    return out


def test_mesh_is_the_source_and_groups_keep_the_timeout():
    out = _mesh_view()
    for r, o in enumerate(out):
        assert o["dims"] == ("pp", "dp", "cp", "tp") and o["shape"] == (1, 2, 1, 2)
        assert o["tp_is_mesh_tp"] and o["via_groups"] and o["world"]
        assert o["tp_ranks"] == ([0, 1] if r < 2 else [2, 3])
        assert o["dp_ranks"] == ([0, 2] if r % 2 == 0 else [1, 3])
        # The world was spawned with 30 s; init(timeout_s=7) reaches every group it made.
        assert o["timeouts"] == [7.0] * 5
        assert "'ep'" in o["no_dim"]
        assert o["user_coords"] == (r // 2, r % 2) and o["user_tp"] == ([0, 2] if r % 2 == 0 else [1, 3])


@distributed(world_size=2, timeout_s=30)
def _default_timeout():
    from overlapkit.runtime.groups import ParallelGroups, group_timeout_s
    g = ParallelGroups.build(tp=2)
    return group_timeout_s(g.tp)


def test_groups_default_to_the_worlds_timeout():
    assert _default_timeout() == [30.0, 30.0]


@distributed(world_size=2, timeout_s=9)
def _init_after_the_world():
    import overlapkit
    from overlapkit.runtime.groups import group_timeout_s
    g = overlapkit.init(tp=2)  # the world exists (9 s): no timeout_s given, so the world's it is
    return [group_timeout_s(x) for x in (g.tp, g.dp, g.pp, g.cp, g.ep)], g.timeout_s


def test_init_without_a_timeout_keeps_the_worlds():
    # Before: init() gave its groups 300 s whatever init_process_group(timeout=) had said.
    for timeouts, recorded in _init_after_the_world():
        assert timeouts == [9.0] * 5 and recorded == 9.0


@distributed(world_size=2, timeout_s=6)
def _sizes_differ():
    import time

    from overlapkit.runtime.agreement import RankMismatchError
    out = {}
    t0 = time.monotonic()
    try:  # rank 0 asks for tp=2 (dp=1), rank 1 for tp=1 (dp=2): both fit the world of 2
        ParallelGroups.build(tp=2 if dist.get_rank() == 0 else 1)
        out["sizes"] = "built"
    except RankMismatchError as e:
        out["sizes"] = str(e)
    try:  # one rank's sizes do not fit the world: every rank says so, the others too
        ParallelGroups.build(tp=2, pp=2 if dist.get_rank() == 1 else 1)
        out["misfit"] = "built"
    except (RankMismatchError, ValueError) as e:
        out["misfit"] = f"{type(e).__name__}: {e}"
    out["took"] = time.monotonic() - t0
    out["after"] = ParallelGroups.build(tp=2).tp_rank  # the world still pairs
    return out


def test_build_compares_sizes_across_ranks_first():
    # Before: a store "wait timeout" naming a key on one rank while the other hung 5x the timeout.
    out = _sizes_differ()
    for r, o in enumerate(out):
        assert o["sizes"].startswith("ParallelGroups.build: ranks [0, 1] were given different configurations"), o
        assert "tp differs (rank 0: 2, rank 1: 1)" in o["sizes"]
        assert "RankMismatchError" in o["misfit"] and "pp differs" in o["misfit"], o
        assert "does not divide the world size 2" in o["misfit"], o  # the problem rank 1 had
        assert o["took"] < 3.0, o  # no timeout was waited for
        assert o["after"] == r
    assert out[0]["sizes"] == out[1]["sizes"]
