"""ZeRO-3 (fully_shard on FSDP2): equal to one process and to plain FSDP2 at every prefetch depth,
really sharded, its gathers on the timeline where prefetch puts them, bad input refused everywhere."""

import pytest

from fsdp_cases import PREFETCH, results

WORLDS = [2, 3]
TOL = 1e-5


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("prefetch", PREFETCH)
@pytest.mark.parametrize("peer", ["single process", "FSDP2"])
def test_grads_and_params_match(world, prefetch, peer):
    for r in results(world):
        assert r[f"prefetch={prefetch} vs {peer}"] <= TOL, r


@pytest.mark.parametrize("world", WORLDS)
def test_fixed_depths_are_set_and_auto_decides_the_same_on_every_rank(world):
    out = results(world)
    for r in out:
        for d in (0, 1, 2):
            assert r[f"prefetch={d} depths"] == (d, d, True)
        assert r["prefetch=(1, 2) depths"] == (1, 2, True)
        fd, bd, decided = r["prefetch=auto depths"]
        assert decided and 0 <= fd <= 4 and 0 <= bd <= 4, r["prefetch=auto reason"]
        assert "forward depth" in r["prefetch=auto reason"] and "MiB" in r["prefetch=auto reason"]
    assert len({r["prefetch=auto depths"] for r in out}) == 1  # gathers must pair across ranks
    assert out[0]["prefetch=auto measured"] == {}  # the default keeps the probe's and the model's pick, untimed
    key = "prefetch=auto, trials"
    assert len({r[f"{key} depths"] for r in out}) == 1
    measured = out[0][f"{key} measured"]
    assert all(r[f"{key} measured"] == measured for r in out)  # the slowest rank's times, everywhere
    if measured:  # the model's pick was timed against its neighbours in 4 paired rounds
        fd, bd, _ = out[0][f"{key} depths"]
        # each depth one a candidate had in its pass (chosen pass by pass, the pair need not be a candidate)
        timed = [tuple(int(d) for d in k.split("/")) for k in measured]
        assert fd in {f for f, _ in timed} and bd in {b for _, b in timed}, (measured, fd, bd)
        assert "measured step" in out[0][f"{key} reason"] and "in 4 rounds" in out[0][f"{key} reason"]


@pytest.mark.parametrize("world", WORLDS)
def test_decided_auto_issues_what_the_fixed_model_at_its_depths_issues(world):
    """auto's probe and trials leave nothing behind: no other collective, order, prefetch list, Python call or clock."""
    for r in results(world):
        assert r["auto decided"], r["decided after"]
        a, f = r["auto issues"], r["fixed issues"]
        assert a["comms"] == f["comms"], (r["auto depths"], a["comms"], f["comms"])
        assert a["lists"] == f["lists"], (r["auto depths"], a["lists"], f["lists"])
        gathers = [c for c in a["comms"] if c[0] == "zero_all_gather"]
        assert len(gathers) == 1 + 4 + 4, gathers  # root once, each block in forward and again in backward
        assert sum(c[0] == "zero_reduce_scatter" for c in a["comms"]) == 5, a["comms"]
        fd, bd = r["auto depths"]
        assert a["lists"][""][0] == [f"blocks.{i}" for i in range(min(fd, 4))], a["lists"]
        assert a["probe stamps"] == 0 and f["probe stamps"] == 0
        # The same Python on the host, call for call (hooks, checks, FSDP2), and no clock read.
        assert r["python calls that differ"] == {}, r["python calls that differ"]
        assert r["python calls"][0] == r["python calls"][1] > 0, r["python calls"]
        # The first steps after the decision too: FSDP2's units, hooks and auto's own state as the fixed model's.
        assert r["same state after each step"] == [True, True, True], r["state"]
        assert r["state"]["zero3"] == (None, False, 0, None, None, None, False, 0), r["state"]["zero3"]
        # And the step itself: the same aten ops on the same shapes, collectives, hooks and held tensors.
        assert r["trace sizes"]["ops"] > 100 and r["held"][0] > 10, (r["trace sizes"], r["held"])
        assert r["trace differences"] == {}, r["trace differences"]


def test_auto_keeps_and_runs_the_depths_its_trials_measured_fastest_pass_by_pass():
    for r in results(2):
        ran, kept = r["trials ran"], r["trials kept"]
        candidates = sorted(set(ran))
        assert len(candidates) >= 2 and len(ran) == 5 * len(candidates), ran  # 1 + 4 rounds, one window each
        # the forward depth of the only candidate unslowed in forward, the backward depth of the only one
        # unslowed in backward: chosen apart (a pair no single candidate was)
        assert kept == (max(candidates)[0], min(candidates)[1]), (kept, r["trials measured"], r["trials reason"])
        assert "by pass: forward depth" in r["trials reason"], r["trials reason"]
        assert set(r["trials measured"]) == {f"{f}/{b}" for f, b in candidates}, r["trials measured"]
        assert "measured step" in r["trials reason"], r["trials reason"]
        auto_lists, fixed_lists = r["trials lists"]
        assert auto_lists == fixed_lists  # the kept depths are the ones FSDP2 runs


@pytest.mark.parametrize("world", WORLDS)
def test_parameters_are_sharded(world):
    for r in results(world):
        assert r["all sharded"]
        # Bound: each parameter's dim 0 padded up to a multiple of the DP size, then split.
        assert r["param bytes per rank"] <= r["padded bound"], r
        assert r["padded bound"] <= r["model param bytes"] / world + 4 * 4 * 13 * 11, r  # <= one padded row each
        assert r["param bytes per rank"] < 0.75 * r["model param bytes"] if world == 2 else \
            r["param bytes per rank"] < 0.5 * r["model param bytes"]


def test_prefetch_moves_the_gather_behind_compute():
    out = results(2)
    for r in out:
        (s0, e0), (z0, z1) = r["depth 0 gather"], r["depth 0 sleep"]
        assert s0 >= z1 - 1.0, r  # depth 0: issued when block 2 starts, after the sleep
        (s1, e1), (y0, y1) = r["depth 1 gather"], r["depth 1 sleep"]
        assert s1 <= y0 and e1 <= y1, r  # depth 1: issued in block 1's pre-forward, landed during the sleep
        assert r["depth 1 blocks.2 exposed"] == 0, r  # all of it under the sleep (compute)
        assert "zero_all_gather" in r["depth 1 kinds"] and "zero_reduce_scatter" in r["depth 1 kinds"]
    # At depth 0 the rank whose peer is still sleeping waits for the gather: exposed. (The
    # other finds it done when it waits, so only the slowest rank's is asserted.)
    assert max(r["depth 0 blocks.2 exposed"] for r in out) > 0, out


@pytest.mark.parametrize("world", WORLDS)
def test_bad_input_fails_on_every_rank(world):
    out = results(world)
    for r in out:
        assert r["prefetch=-1 everywhere"][0] == "ValueError" and "integer >= 0" in r["prefetch=-1 everywhere"][1]
        kind, msg = r["prefetch=-1 on the last rank"]
        assert kind == "RankMismatchError" and "prefetch differs" in msg and "integer >= 0" in msg, msg
        assert r["prefetch differs"][0] == "RankMismatchError" and "prefetch differs" in r["prefetch differs"][1]
        kind, msg = r["prefetch pair with -1"]
        assert kind == "ValueError" and "(forward, backward) pair" in msg and "(1, -1)" in msg, msg
        assert r["wrap names no module"][0] == "ValueError" and "'nope'" in r["wrap names no module"][1]
        assert "blocks" in r["wrap names no module"][1]  # names what the model has
        assert r["wrap names no module on rank 0"][0] == "RankMismatchError"
        for name in ("prefetch=-1 on the last rank", "wrap names no module on rank 0"):
            assert r[name + " seconds"] < 10, r
        assert r["after bad input, sum"] == world
