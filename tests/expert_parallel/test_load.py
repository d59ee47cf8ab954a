"""The load-imbalance numbers the timeline report prints for a MoE layer."""

from overlapkit.timeline.report import load_imbalance


def test_load_imbalance_max_over_mean_per_expert_and_per_rank():
    load = load_imbalance([[6, 2], [0, 0]], dropped=1)
    assert load.per_expert == [6, 2, 0, 0] and load.per_rank == [8, 0]
    assert load.expert_max_over_mean == 3.0 and load.rank_max_over_mean == 2.0
    assert "max/mean 3.00" in load.line() and "dropped 1" in load.line()
    even = load_imbalance([[2, 2], [2, 2]])
    assert even.expert_max_over_mean == 1.0 and even.rank_max_over_mean == 1.0
    assert load_imbalance([[0], [0]]).rank_max_over_mean is None  # no tokens: no ratio, not a division by 0
