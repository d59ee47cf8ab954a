"""split_backward: 1F1B, interleaved 1F1B and GPipe whose backwards compute the input gradient, send
it on, then run the weight-gradient GEMMs. Loss and every gradient equal one process (pp = 4, 3, 2,
with DP = 2 and TP = 2); the recorded spans show each gradient leaving before its own W starts, every
weight-gradient GEMM inside a W, and the timetable's order and micro-batches in flight unchanged.

One world of 4 gloo ranks: pp=4; pp=3 on ranks 0-2; pp=2 x dp=2; pp=2 x tp=2.
"""

import datetime
import functools

import pytest
import torch.distributed as dist

from distributed import distributed
from overlapkit.pipeline_parallel import PipelineConfig, price, rank_actions, rank_slots, timetable
from overlapkit.runtime.groups import ParallelGroups
from pp_cases import Layout, layout_of, pipeline_case
from pp_split_cases import linears_case

TOL = 1e-5

# (schedule, v, m, overlap_p2p, layers)
PP4 = [("1f1b", 1, 8, True, 4), ("interleaved-1f1b", 2, 8, True, 8), ("gpipe", 1, 4, False, 4)]
PP3 = [("1f1b", 1, 5, True, 3), ("interleaved-1f1b", 2, 6, False, 6)]
PP2_DP2 = [("1f1b", 1, 4, True, 2), ("interleaved-1f1b", 2, 4, True, 4)]
PP2_TP2 = [("1f1b", 1, 4, True, 2, "pipelined"), ("interleaved-1f1b", 2, 4, True, 4, "bulk")]


@distributed(world_size=4, timeout_s=60)
def _world4():
    out, grads = {}, {}
    groups = ParallelGroups.build(pp=4)
    for c in PP4:
        grads[("pp4",) + c] = pipeline_case(layout_of(groups), *c, split_backward=True)
    out["spans pp4 1f1b"] = linears_case(groups.pp, "1f1b", 8, split_backward=True)
    sub3 = dist.new_group([0, 1, 2], timeout=datetime.timedelta(seconds=60))
    if dist.get_rank() < 3:
        for c in PP3:
            grads[("pp3",) + c] = pipeline_case(Layout(pp=sub3), *c, steps=2, split_backward=True)
        out["spans pp3 interleaved"] = linears_case(sub3, "interleaved-1f1b", 6, split_backward=True)
    two = ParallelGroups.build(pp=2, dp=2)
    for c in PP2_DP2:
        grads[("pp2 dp2",) + c] = pipeline_case(layout_of(two), *c, steps=2, split_backward=True)
    tp = ParallelGroups.build(pp=2, tp=2)
    for c in PP2_TP2:
        grads[("pp2 tp2",) + c] = pipeline_case(layout_of(tp), *c[:5], tp_overlap=c[5], split_backward=True)
    out["grads"] = grads
    return out


@functools.cache
def _results():
    return _world4()


def test_split_backward_matches_one_process():
    for rank, res in enumerate(_results()):
        assert len(res["grads"]) == (9 if rank < 3 else 7)
        for case, err in res["grads"].items():
            assert err <= TOL, (rank, case, err)
        for key in ("spans pp4 1f1b", "spans pp3 interleaved"):
            if key in res:
                assert res[key]["err"] <= TOL, (rank, key, res[key]["err"])


def test_each_gradient_leaves_before_its_weight_gradients_run():
    for key in ("spans pp4 1f1b", "spans pp3 interleaved"):
        for rank, res in enumerate(_results()):
            if key not in res:
                continue
            spans = res[key]["spans"]
            ws = {name: (a, b) for kind, name, a, b in spans
                  if kind == "compute" and name.startswith("pp.W") and not name.endswith(".wgrad")}
            bs = {name: (a, b) for kind, name, a, b in spans if kind == "compute" and name.startswith("pp.B")}
            assert ws and len(ws) == len(bs), (key, rank)
            for name, (start, _) in ws.items():
                assert start >= bs["pp.B" + name.removeprefix("pp.W")][1], (key, rank, name)
            # Every weight-gradient GEMM ran inside a W (B computed input gradients only).
            gemms = [(a, b) for kind, name, a, b in spans if kind == "compute" and name.endswith(".wgrad")]
            assert gemms, (key, rank)
            for a, b in gemms:
                assert any(s <= a and b <= e for s, e in ws.values()), (key, rank, a, b)
            # A rank that sends gradients back (not the first) posts each one before that micro-batch's W.
            sends = sorted(a for kind, name, a, _ in spans if kind == "pp_send")
            if rank > 0 and key == "spans pp4 1f1b":
                for name, (start, _) in ws.items():
                    b_start = bs["pp.B" + name.removeprefix("pp.W")][0]
                    assert any(b_start <= t <= start for t in sends), (rank, name)


def test_split_keeps_the_order_and_the_micro_batches_in_flight():
    for s, v, m in (("1f1b", 1, 8), ("interleaved-1f1b", 2, 8), ("gpipe", 1, 4)):
        for r in range(4):
            whole = [(a.op, a.mb, a.chunk) for a in rank_actions(s, 4, v, m, r)]
            split = [(a.op, a.mb, a.chunk) for a in rank_actions(s, 4, v, m, r, split_backward=True)]
            assert [a for a in split if a[0] != "W"] == whole
            for i, a in enumerate(split):  # each W right after its B
                assert (a[0] == "W") == (i > 0 and split[i - 1][0] == "B" and split[i - 1][1:] == a[1:])
        whole, split = price(timetable(s, 4, v, m), 1 / v, 2 / v), \
            price(timetable(s, 4, v, m, split_backward=True), 1 / v, 1 / v, 1 / v)
        assert split.peak_alive == whole.peak_alive and split.busy == whole.busy
        assert split.step < whole.step  # the gradients travel back sooner: a shorter step
    assert price(timetable("1f1b", 4, 1, 8, split_backward=True), 1, 1, 1).step == 30  # 33 without


def test_split_backward_is_refused_where_the_schedule_places_w_itself():
    for s, v in (("zb1p", 1), ("zbv", 2), ("dualpipev", 2)):
        with pytest.raises(ValueError, match="split_backward"):
            PipelineConfig(schedule=s, microbatches=8, virtual_stages=v, split_backward=True)
        with pytest.raises(ValueError, match="split_backward"):
            rank_slots(s, 4, v, 8, 0, split_backward=True)
    with pytest.raises(ValueError, match="split_backward"):
        PipelineConfig(split_backward=1)
