"""Alpha-beta collectives: the seed's 70 ms, ring vs tree, hierarchy, nccl-tests tables."""

import math
from dataclasses import replace

import pytest

from overlapkit.costmodel import Collectives, ConfigError, Group, Link, parse_nccl_tests, preset

FLAT_50 = Link("50 GB/s", alpha_us=0.0, bandwidth_gbps=50.0, efficiency=1.0)


def _hw(intra=FLAT_50, inter=FLAT_50):
    return replace(preset("h200-sxm"), intra=intra, inter=inter)


def test_seed_all_reduce_of_one_billion_bf16_gradients_takes_70_ms():
    coll = Collectives(_hw())
    assert coll.time_ms("all_reduce", 2e9, Group(8, 1), "ring") == pytest.approx(70.0)
    assert coll.time_ms("all_reduce", 2e9, Group(8, 8), "ring") == pytest.approx(70.0)  # same link inside


def test_alpha_beta_formulas():
    link = Link("l", alpha_us=10.0, bandwidth_gbps=100.0, efficiency=0.5)  # bus 50 GB/s
    coll, g = Collectives(_hw(intra=link)), Group(4, 4)
    s = 1e8
    assert coll.time_ms("all_reduce", s, g, "ring") == pytest.approx(6 * 0.01 + 1.5 * s / 50e6)
    assert coll.time_ms("all_reduce", s, g, "tree") == pytest.approx(4 * 0.01 + 2 * s / 50e6)
    assert coll.time_ms("all_gather", s, g) == pytest.approx(3 * 0.01 + 0.75 * s / 50e6)
    assert coll.time_ms("reduce_scatter", s, g) == coll.time_ms("all_gather", s, g)
    assert coll.time_ms("all_to_all", s, g) == coll.time_ms("all_gather", s, g)
    assert coll.time_ms("send_recv", s, Group(2, 2)) == pytest.approx(0.01 + s / 50e6)
    # Small messages: the tree's log2(n) steps beat the ring's 2(n-1).
    big = Group(64, 64)
    assert coll.time_ms("all_reduce", 1e3, big) == coll.time_ms("all_reduce", 1e3, big, "tree")
    assert coll.time_ms("all_reduce", 1e3, big, "tree") < coll.time_ms("all_reduce", 1e3, big, "ring")
    assert coll.time_ms("all_reduce", 1e10, big) == coll.time_ms("all_reduce", 1e10, big, "ring")
    assert coll.time_ms("all_reduce", s, Group(1, 1)) == 0.0


def test_hierarchical_all_reduce_across_nodes():
    fast, slow = Link("nvl", 0.0, 400.0, 1.0), Link("ib", 0.0, 50.0, 1.0)
    coll = Collectives(_hw(fast, slow))
    s, g = 8e8, Group(16, 8)  # two nodes of eight
    rs_ag = 2 * (7 / 8) * s / 400e6
    inter = 2 * (1 / 2) * (s / 8) / 50e6
    assert g.spans_nodes
    assert coll.time_ms("all_reduce", s, g, "ring") == pytest.approx(rs_ag + inter)
    assert coll.time_ms("all_gather", s, g) == pytest.approx(7 / 8 * s / 400e6 + 1 / 2 * (s / 8) / 50e6)
    # One rank per node: the whole ring runs over the network.
    assert coll.time_ms("all_reduce", s, Group(4, 1), "ring") == pytest.approx(1.5 * s / 50e6)


def test_group_layout_from_stride():
    assert Group.strided(8, 1, 8) == Group(8, 8)      # TP
    assert Group.strided(4, 8, 8) == Group(4, 1)      # DP behind TP=8: one rank per node
    assert Group.strided(8, 2, 8) == Group(8, 4)      # DP behind TP=2: four per node
    assert not Group.strided(4, 2, 8).spans_nodes


NCCL_TESTS = """# nThread 1 nGpus 1 minBytes 1024 maxBytes 1073741824 step: 4(factor) warmup iters: 5 iters: 20
#
# Using devices
#  Rank  0 Group  0 Pid  1 on host device  0 [0x18] NVIDIA H100 80GB HBM3
#  Rank  1 Group  0 Pid  2 on host device  1 [0x2a] NVIDIA H100 80GB HBM3
#  Rank  2 Group  0 Pid  3 on host device  2 [0x3a] NVIDIA H100 80GB HBM3
#  Rank  3 Group  0 Pid  4 on host device  3 [0x5d] NVIDIA H100 80GB HBM3
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
        1024           256     float     sum      -1    10.00    0.10    0.15      0    10.00    0.10    0.15      0
     1048576        262144     float     sum      -1    20.00   52.43   78.64      0    20.00   52.43   78.64      0
  1073741824     268435456     float     sum      -1  4000.00  268.44  402.65      0  4000.00  268.44  402.65      0
# Out of bounds values : 0 OK
"""


def test_nccl_tests_table_replaces_the_formula_for_its_group():
    table = parse_nccl_tests(NCCL_TESTS, "all_reduce")
    assert table.ranks == 4 and table.points[0] == (1024, 10.0)
    coll = Collectives(preset("h100-sxm"), (table,))
    assert coll.time_ms("all_reduce", 1048576, Group(4, 4)) == pytest.approx(0.020)
    mid = coll.time_ms("all_reduce", 2**25, Group(4, 4))  # log-log between 20 us at 1 MiB and 4 ms at 1 GiB
    assert mid == pytest.approx(math.exp(math.log(20) + 0.5 * math.log(200)) * 1e-3)
    assert coll.time_ms("all_reduce", 2**31, Group(4, 4)) == pytest.approx(8.0)  # beyond: the largest's bandwidth
    assert coll.time_ms("all_reduce", 100, Group(4, 4)) == pytest.approx(0.010)
    # Other sizes and kinds still use the formula.
    assert coll.time_ms("all_reduce", 2**25, Group(8, 8)) == Collectives(preset("h100-sxm")).time_ms(
        "all_reduce", 2**25, Group(8, 8))


def test_nccl_tests_without_ranks_or_rows_is_refused():
    with pytest.raises(ConfigError, match="Rank"):
        parse_nccl_tests("        1024  256 float sum -1 10.0 0.1 0.1 0\n", "all_reduce")
    with pytest.raises(ConfigError, match="need at least 2"):
        parse_nccl_tests("#  Rank  0 Group\n", "all_gather")
    with pytest.raises(ConfigError, match="kind"):
        parse_nccl_tests(NCCL_TESTS, "broadcast")
