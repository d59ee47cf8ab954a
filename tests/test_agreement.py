"""Cross-rank agreement: every rank raises the same message naming the field that differs."""

import time

import pytest
import torch.distributed as dist
from distributed import distributed

from overlapkit.runtime.agreement import Agreement, RankMismatchError, agree


@distributed(world_size=3, timeout_s=20)
def _agree(per_rank_chunks, what_per_rank=None):
    r = dist.get_rank()
    a = Agreement("layer")
    try:
        a.check(dist.group.WORLD, chunks=per_rank_chunks[r], shape=(4, 8))
        a.check(dist.group.WORLD, chunks=per_rank_chunks[r], shape=(4, 8))  # seen: no store traffic
        if what_per_rank:
            agree(dist.group.WORLD, what_per_rank[r], x=1)
        return "ok"
    except RankMismatchError as e:
        return str(e)


def test_same_configuration_passes():
    assert _agree([2, 2, 2]) == ["ok"] * 3


def test_differing_field_named_on_every_rank():
    out = _agree([2, 4, 2])
    assert len(set(out)) == 1, out
    assert "chunks differs (rank 0: 2, rank 1: 4, rank 2: 2)" in out[0] and "shape" not in out[0]


def test_different_engines_checking_fail_too():
    out = _agree([1, 1, 1], what_per_rank=["a", "b", "a"])
    assert len(set(out)) == 1 and "what differs" in out[0]


@distributed(world_size=2, timeout_s=20)
def _one_rank_skips():
    t0 = time.monotonic()
    if dist.get_rank() == 0:
        try:
            agree(dist.group.WORLD, "layer", timeout_s=2, chunks=2)
        except RankMismatchError as e:
            return str(e), time.monotonic() - t0
        return "returned", 0.0
    time.sleep(4)  # rank 1 never checks (it "reused a seen configuration")
    return "skipped", 0.0


def test_a_rank_that_never_checks_is_named_within_the_timeout():
    (msg, took), _ = _one_rank_skips()
    assert "rank(s) [1]" in msg and "did not compare" in msg
    assert took < 2 + 1.5


def test_no_group_and_single_rank_pass():
    agree(None, "x", a=1)
    Agreement("x").check(None, a=1)
