"""`overlapkit demo --ep`: the GPT with MoE blocks trains under EP carved from DP and matches one process."""

import pytest

from overlapkit.demos import TOLERANCE, DemoConfig
from worlds import world

DEMO = DemoConfig(tp=1, dp=2, ep=2, steps=2, overlap="none")


def test_demo_with_ep_from_dp_matches_one_process():
    results = [r["demo"] for r in world(2)]
    for r in results:
        assert all(s["rel_err"] <= TOLERANCE for s in r["steps"]), r["steps"]
        (layer, per_expert, dropped), = r["moe_loads"]
        assert layer == "blocks.1.moe" and len(per_expert) == 2 and dropped == 0
    kinds = {s.kind for s in results[0]["spans"] if s.is_comm}
    assert {"ep_dispatch", "ep_combine"} <= kinds


def test_demo_refuses_ep_that_is_not_dp():
    with pytest.raises(ValueError, match=r"DemoConfig.ep=2 must be 1 or equal dp=4"):
        DemoConfig(tp=1, dp=4, ep=2)
