"""ShardedOptimizer after n steps equals the plain optimizer in one process; its state round-trips."""

import pytest

from dp_cases import results

WORLDS = [2, 3]
TOL = 1e-5


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("opt", ["Adam", "AdamW"])
@pytest.mark.parametrize("buckets", ["one param per bucket", "one bucket"])
@pytest.mark.parametrize("overlap_param_gather", [True, False])
def test_sharded_steps_match_single_process(world, opt, buckets, overlap_param_gather):
    for r in results(world):
        assert r[f"{opt}, {buckets}, overlap_param_gather={overlap_param_gather}"] <= TOL, r


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("opt", ["Adam", "AdamW"])
def test_plain_parameters(world, opt):
    for r in results(world):
        assert r[f"{opt}, plain parameters"] <= TOL, r


@pytest.mark.parametrize("world", WORLDS)
def test_state_dict_round_trip(world):
    for r in results(world):
        assert r["state_dict round trip"] <= TOL, r
        assert r["master dtype"] == "torch.float32", r


@pytest.mark.parametrize("world", WORLDS)
def test_foreign_shard_fails_on_every_rank(world):
    out = results(world)
    assert "rank=0 (expected" in out[world - 1]["foreign shard"]
    for r in out[:-1]:
        assert f"rank(s) [{world - 1}]" in r["foreign shard"], r
