"""The GPU's wait for its host through the launch queue (costmodel.host_queue): the host's lead carries from one
stretch of work to the next, up to the queue's depth."""

import pytest

from overlapkit.costmodel.host_queue import LAUNCH_QUEUE_OPS, queue_wait_ms


def test_the_gpu_waits_only_while_the_host_is_behind_over_the_stretch_so_far():
    # dispatch 2 ms and work 1 ms a unit: the GPU waits 1 ms per unit after the first unit's full 2 ms dispatch
    assert queue_wait_ms([(2.0, 1.0, 10)] * 3) == pytest.approx(6.0 - 3.0)
    # the work outlasts the dispatch everywhere: no wait but the first unit's dispatch beyond its work
    assert queue_wait_ms([(1.0, 2.0, 10)] * 3) == pytest.approx(0.0)
    assert queue_wait_ms([]) == 0.0


def test_a_long_stretch_of_work_gives_the_host_a_lead_that_later_host_heavy_units_spend():
    head = (0.0, 5.0, 0)  # the LM head: long work, nothing to dispatch
    heavy = (2.0, 1.0, 10)
    carried = queue_wait_ms([(1.0, 1.0, 10), head, heavy, heavy])
    # the head's 5 ms lets the host dispatch both heavy units (4 ms) before the GPU needs them
    assert carried == pytest.approx(0.0)
    # each unit alone against its own work (no lead carried) would have charged 1 ms per heavy unit
    per_unit = sum(max(0.0, h - g) for h, g, _ in [(1.0, 1.0, 10), head, heavy, heavy])
    assert per_unit == pytest.approx(2.0) and carried < per_unit


def test_the_lead_is_bounded_by_the_launch_queue():
    """A host that would run far ahead is stopped by a full queue: its launches wait for the work a queue's
    depth behind them to end."""
    ops = LAUNCH_QUEUE_OPS // 4
    long_work = [(0.1, 10.0, ops)] * 8  # 80 ms of work in 8 units, a queue's depth every 4 units
    tail = [(50.0, 0.1, 1)]  # host-heavy
    # unbounded, the host would have dispatched the 8 units by 0.8 ms and the tail by 50.8 ms, under the work
    assert 0.8 + 50.0 < 80.0
    # bounded, the tail's launch comes only after the unit a queue's depth before it (the 4th) has ended at
    # 40 ms: it is dispatched at 90 ms, and the GPU, done at 80 ms, waits for it
    assert queue_wait_ms(long_work + tail) == pytest.approx((40.0 + 50.0) - 80.0, abs=0.2)
