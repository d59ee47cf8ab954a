"""A parameter without a gradient fails on every rank, naming it, within seconds; find_unused reduces zeros."""

import pytest

from dp_cases import results

WORLDS = [2, 3]


@pytest.mark.parametrize("world", WORLDS)
def test_unused_everywhere_fails_on_every_rank(world):
    for r in results(world):
        msg = r["unused everywhere"]
        assert msg is not None and "spare.weight" in msg and "spare.bias" in msg, r
        assert f"on {world} of {world} ranks" in msg and "find_unused=True" in msg, msg
        assert "fc1" not in msg and "fc2" not in msg, msg
        assert r["unused everywhere seconds"] < 10.0, r
        assert r["after unused everywhere, sum of ranks"] == world * (world + 1) / 2, r


@pytest.mark.parametrize("world", WORLDS)
def test_unused_on_some_ranks_fails_on_every_rank(world):
    for r in results(world):  # rank 0 used the parameter, the others did not: all of them raise
        msg = r["unused on ranks > 0"]
        assert msg is not None and f"spare.weight (on {world - 1} of {world} ranks)" in msg, r
        assert r["unused on ranks > 0 seconds"] < 10.0, r
        assert r["after unused on ranks > 0, sum of ranks"] == world * (world + 1) / 2, r


@pytest.mark.parametrize("world", WORLDS)
def test_find_unused_reduces_zeros(world):
    for r in results(world):
        assert r["find_unused vs single process"] <= 1e-5, r
        assert r["find_unused, unused everywhere, spare grad norm"] == 0.0, r
