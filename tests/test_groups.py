import pytest
import torch.distributed as dist

from distributed import distributed
from overlapkit.groups import ParallelGroups, ParallelSizes


def test_layout_tp_adjacent():
    s = ParallelSizes(tp=2, dp=3, pp=2)
    assert s.world_size == 12
    assert s.tp_groups()[0] == [0, 1]
    assert s.dp_groups()[0] == [0, 2, 4]
    assert s.pp_groups()[0] == [0, 6]
    assert s.coords(7) == (1, 0, 1)
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
    with pytest.raises(ValueError, match=r"tp=2 x dp=2 x pp=1 = 4 does not equal the world size 3"):
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
    assert all(o[3] == "tp=3 x pp=1 = 3 does not divide the world size 4" for o in out)
