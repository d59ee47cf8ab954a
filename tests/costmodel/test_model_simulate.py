"""The stream simulator and the overlap schedules built on it: seed examples, exact small cases."""

import pytest

from overlapkit.costmodel.overlap import ag_gemm_ms, bucket_sizes, buckets_ms, bulk_ms, gemm_rs_ms, layered_ms, ring_pieces
from overlapkit.costmodel.simulate import COMPUTE, Task, makespan, simulate

MIB = 2**20


def test_streams_are_fifo_and_dependencies_wait():
    placed = simulate([Task("a", COMPUTE, "compute", 2.0), Task("c", "tp_all_gather", "comm", 3.0),
                       Task("b", COMPUTE, "compute", 1.0, deps=(1,)), Task("d", "tp_all_gather", "comm", 1.0)])
    assert [(p.start_ms, p.end_ms) for p in placed] == [(0, 2), (0, 3), (3, 4), (3, 4)]
    with pytest.raises(ValueError, match="only earlier tasks"):
        simulate([Task("x", COMPUTE, "compute", 1.0, deps=(0,))])


def test_contention_slows_compute_only_while_the_transfer_runs():
    placed = simulate([Task("ar", "dp_all_reduce", "comm", 1.0, contention=1.5),
                       Task("gemm", COMPUTE, "compute", 2.0)])
    # 1 ms at 1/1.5 speed does 2/3 ms of work; 4/3 ms remain at full speed.
    assert placed[1].end_ms == pytest.approx(1.0 + 4 / 3)
    # Other ranks are not slowed.
    other = simulate([Task("ar", "dp_all_reduce", "comm", 1.0, contention=1.5, rank=1),
                      Task("gemm", COMPUTE, "compute", 2.0)])
    assert other[1].end_ms == 2.0


def test_seed_dp_example_370_ms_sequential_301_ms_with_25_mib_buckets():
    def price(nbytes):
        return 2 * 7 / 8 * nbytes / 50e6  # ring all-reduce over 8 ranks at 50 GB/s, ms

    sizes = bucket_sizes(2e9, 25 * MIB)
    assert sum(sizes) == pytest.approx(2e9) and sizes[-1] == 25 * MIB and len(sizes) == 77
    assert 100 + 200 + sum(price(b) for b in sizes) == pytest.approx(370.0)
    step = 100 + buckets_ms(sizes, 200.0, price, contention=1.0)
    assert step == pytest.approx(300.9, abs=0.05)  # only the last bucket (0.9 ms) is exposed
    # T_exposed = max(0, T_comm - T_hide) + T_last, the seed's formula
    assert step - 300 == pytest.approx(max(0.0, 70 - 200) + price(25 * MIB), rel=1e-6)


def test_seed_short_backward_leaves_at_least_20_ms_exposed():
    def price(nbytes):
        return 2 * 7 / 8 * nbytes / 50e6

    exposed = buckets_ms(bucket_sizes(2e9, 25 * MIB), 50.0, price, 1.0) - 50.0
    assert 20.0 <= exposed <= 20.0 + price(25 * MIB)


def test_ring_pieces():
    assert ring_pieces(8, 8) == (8, 1)
    assert ring_pieces(16, 8) == (16, 2)
    assert ring_pieces(2, 8) == (8, 1)
    with pytest.raises(ValueError, match="divide"):
        ring_pieces(3, 8)


def test_pipelined_all_gather_and_reduce_scatter_hide_all_but_one_piece():
    # 8 chunks of 1 ms; 7 remote pieces. Fast transfers: all hidden.
    assert ag_gemm_ms(1.0, 8, 8, 0.5, 1.0) == pytest.approx(8.0)
    assert gemm_rs_ms(1.0, 8, 8, 0.5, 1.0) == pytest.approx(8.0)  # the last remote piece hides behind the own chunk
    # Slow transfers: the ring is the critical path, plus one chunk.
    assert ag_gemm_ms(1.0, 8, 8, 1.5, 1.0) == pytest.approx(7 * 1.5 + 1.0)
    assert gemm_rs_ms(1.0, 8, 8, 1.5, 1.0) == pytest.approx(1.0 + 7 * 1.5)
    # Contention: every chunk beside a transfer runs 1.2x longer.
    assert ag_gemm_ms(1.0, 8, 8, 10.0, 1.2) == pytest.approx(70.0 + 1.0)
    assert ag_gemm_ms(1.0, 2, 2, 10.0, 1.2) == pytest.approx(10.0 + 1.0)
    # The local chunk runs beside the one transfer: its first 1 ms does 2/3 ms of work.
    assert ag_gemm_ms(2.0, 2, 2, 1.0, 1.5) == pytest.approx(2.0 + 2.0 + (1.0 - 1 / 1.5))


def test_bulk_and_layered():
    assert bulk_ms(1.0, 2.0, 1.0) == 2.0 and bulk_ms(3.0, 2.0, 1.0) == 3.0
    assert bulk_ms(1.0, 2.0, 1.1) == pytest.approx(1.0 + (2.0 - 1 / 1.1))
    # Gathers of 1 ms before computes of 2 ms, prefetched one ahead: only the first is exposed.
    assert layered_ms([1.0] * 4, [2.0] * 4, [0.0] * 4, 1.0) == pytest.approx(9.0)
    # Gathers longer than compute: the comm stream sets the pace.
    assert layered_ms([3.0] * 4, [2.0] * 4, [0.0] * 4, 1.0) == pytest.approx(14.0)
    # With a reduce after each layer on the same stream.
    assert layered_ms([1.0] * 4, [2.0] * 4, [1.0] * 4, 1.0) == pytest.approx(10.0)


def test_makespan_of_nothing_is_zero():
    assert makespan(simulate([])) == 0.0
