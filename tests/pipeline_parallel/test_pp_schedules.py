"""Schedules and cuts, no processes: every allowed (schedule, pp, v, m) finishes, runs each
forward, backward (and, split, weight-gradient backward) once, keeps its order of transfers the same
on both ends, and the bad ones are refused naming the value; what each schedule costs with given
durations (its bubble, what it keeps) is what its design promises."""

import pytest
import torch
from torch import nn

from overlapkit.models import GPT, GPTConfig
from overlapkit.pipeline_parallel import (SCHEDULES, SPLIT_SCHEDULES, bubble_fraction, check_schedule,
                                          chunks_of, placement, price, rank_actions, rank_of, rank_slots,
                                          sequential_chunks, split_layers, timetable)
from overlapkit.models import gpt_chunks
from overlapkit.pipeline_parallel.p2p import producer_key


def _allowed():
    for s in SCHEDULES:
        for pp in (1, 2, 3, 4):
            for v in (1, 2, 3):
                for m in range(1, 10):
                    try:
                        check_schedule(s, pp, v, m)
                    except ValueError:
                        continue
                    yield s, pp, v, m


def test_every_allowed_schedule_finishes_and_runs_each_action_once():
    n = 0
    for s, pp, v, m in _allowed():
        table = timetable(s, pp, v, m)
        n += 1
        ops = "FBW" if s in SPLIT_SCHEDULES else "FB"
        for r in range(pp):
            ran = [a for _, slot in table.ticks[r] for a in slot]
            want = {(op, mb, c) for op in ops for mb in range(m) for c in chunks_of(r, pp, v, placement(s))}
            assert sorted((a.op, a.mb, a.chunk) for a in ran) == sorted(want), (s, pp, v, m, r)
            assert all(rank_of(a.chunk, pp, placement(s)) == r for a in ran)
            ticks = [t for t, _ in table.ticks[r]]
            assert ticks == sorted(set(ticks))  # one slot a tick, in the rank's order
            assert ran == rank_actions(s, pp, v, m, r)
            for c in chunks_of(r, pp, v, placement(s)):  # a chunk's W run in micro-batch order (the last W is the last B's)
                assert [a.mb for a in ran if a.op == "W" and a.chunk == c] == (list(range(m)) if "W" in ops else [])
        when = {(a.op, a.chunk, a.mb): t for row in table.ticks for t, slot in row for a in slot}
        for (op, c, mb), t in when.items():  # a W never runs before its B (beside it: a whole backward)
            assert op != "W" or when[("B", c, mb)] <= t, (s, pp, v, m, c, mb)
        # Every transfer is consumed strictly after it was produced, on another rank.
        for t in table.transfers:
            assert t.src != t.dst and when[(t.action.op, t.action.chunk, t.action.mb)] > t.tick
            assert when[producer_key(t)] == t.tick
    assert n > 100


@pytest.mark.parametrize("overlap", [True, False])
def test_both_ends_issue_transfers_in_the_same_order(overlap):
    # What NCCL needs (it matches point-to-point by order, not tag): the sends a posts to b come
    # in the order b posts its receives from a; and every tag is unique in a step (what gloo matches).
    for s, pp, v, m in _allowed():
        table = timetable(s, pp, v, m)
        lag = 1 if overlap else 0
        for a in range(pp):
            for b in range(pp):
                sent = [t for tick in range(table.n_ticks) for t in table.sends(a).get(tick, []) if t.dst == b]
                posted = [t for tick in range(-lag, table.n_ticks) for t in table.recvs(b).get(tick + lag, [])
                          if t.src == a]
                assert sent == posted, (s, pp, v, m, a, b)
        assert len({(t.src, t.dst, t.tag) for t in table.transfers}) == len(table.transfers)


def test_1f1b_order_is_the_textbook_one():
    # pp=4, m=4, rank 1: two warm-up forwards, then one forward one backward, then the drain.
    order = [(a.op, a.mb) for a in rank_actions("1f1b", 4, 1, 4, 1)]
    assert order == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]
    assert [(a.op, a.mb) for a in rank_actions("1f1b", 4, 1, 4, 3)] == [("F", 0), ("B", 0), ("F", 1), ("B", 1),
                                                                         ("F", 2), ("B", 2), ("F", 3), ("B", 3)]


def test_timetable_length_is_the_bubble_formula():
    # Unit-time ticks, forward = backward: 2·v·m busy ticks + 2·(p-1) ticks of bubble (1F1B, interleaved).
    for pp, v, m in ((2, 1, 4), (4, 1, 8), (4, 2, 4), (2, 2, 4), (3, 2, 6)):
        s = "1f1b" if v == 1 else "interleaved-1f1b"
        assert timetable(s, pp, v, m).n_ticks == 2 * v * m + 2 * (pp - 1), (pp, v, m)
    assert bubble_fraction(4, 2, 8) == pytest.approx(3 / 16)


@pytest.mark.parametrize("args, needle", [
    (("1f1b", 4, 1, 3), "microbatches=3 < pp=4"),
    (("interleaved-1f1b", 2, 2, 3), "microbatches=3, pp=2"),
    (("1f1b", 2, 2, 4), "virtual_stages=2"),
    (("zero-bubble", 2, 1, 4), "'zero-bubble'"),
    (("gpipe", 2, 1, 0), "microbatches=0"),
    (("zb1p", 2, 2, 4), "virtual_stages=2"),
    (("zb1p", 4, 1, 3), "microbatches=3 < pp=4"),
    (("zbv", 2, 1, 4), "virtual_stages=1 must be 2"),
    (("dualpipev", 3, 2, 5), "microbatches=5 < 6"),
    (("dualpipev", 1, 2, 4), "pp >= 2"),
])
def test_bad_schedules_are_refused_naming_the_value(args, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace("'", "'")):
        check_schedule(*args)


def _bubble_vs_1f1b(s: str, pp: int, m: int, f: float, b: float, w: float) -> float:
    """A schedule's bubble over 1F1B's, stage durations f, b (input gradient), w (weight gradient)."""
    v = 2 if s in ("zbv", "dualpipev") else 1
    one = price(timetable("1f1b", pp, 1, m), f, b + w)
    return price(timetable(s, pp, v, m, (f, b, w)), f / v, b / v, w / v).bubble_fraction / one.bubble_fraction


def test_priced_bubbles_are_what_the_designs_promise():
    for pp in (2, 3, 4):
        for m in (2 * pp, 3 * pp):
            one = price(timetable("1f1b", pp, 1, m), 1.0, 2.0)
            assert one.bubble_fraction == pytest.approx((pp - 1) / m)  # the textbook (p-1)/m
            assert one.peak_alive == [pp - r for r in range(pp)] and one.peak_kept_w == [0] * pp
            for f, b, w in ((1, 1, 1), (1, 1.5, 1), (2, 1, 1), (1, 0.5, 1.5)):
                # ZB-H1 (Qi et al.): (p-1)·(F + B - W) of bubble, never below the warm-up's (p-1)·F.
                zb = price(timetable("zb1p", pp, 1, m), f, b, w)
                assert max(zb.step - x for x in zb.busy) == pytest.approx((pp - 1) * max(f, f + b - w))
                assert zb.peak_alive == [pp] * pp  # from F to W: 1F1B's peak (its first rank's) on every rank
            assert _bubble_vs_1f1b("zb1p", pp, m, 1, 1, 1) == pytest.approx(1 / 3)
            # ZB-V at F = B = W: only the warm-up's half-stage forwards are left, 1/6 of 1F1B's bubble;
            # DualPipeV: (p-1)(F&B + B - 3W) (DeepSeek's table), 1/3 of 1F1B's when the pair hides no compute.
            assert _bubble_vs_1f1b("zbv", pp, m, 1, 1, 1) == pytest.approx(1 / 6)
            assert _bubble_vs_1f1b("dualpipev", pp, m, 1, 1, 1) == pytest.approx(1 / 3)
            zbv = price(timetable("zbv", pp, 2, m), 0.5, 0.5, 0.5)
            assert max(zbv.peak_alive) == 2 * pp  # chunk-micro-batches: pp stage activations, 1F1B's peak
            dpv = price(timetable("dualpipev", pp, 2, m), 0.5, 0.5, 0.5)
            assert max(dpv.peak_alive) == 2 * pp + 1  # DualPipeV's PP + 1 (in stages of half a rank)


def test_zbv_order_follows_the_costs_it_is_given():
    # With B slower than F, the order built for those costs leaves less bubble than the equal-cost one.
    for pp in (2, 4):
        m = 2 * pp
        t_eq, t_fit = timetable("zbv", pp, 2, m), timetable("zbv", pp, 2, m, (1.0, 1.2, 0.8))
        assert price(t_fit, 0.5, 0.6, 0.4).step < price(t_eq, 0.5, 0.6, 0.4).step
    assert rank_slots("zbv", 2, 2, 4, 0) == rank_slots("zbv", 2, 2, 4, 0, (2, 2, 2))  # only ratios matter
    with pytest.raises(ValueError, match=r"costs=\(1, 0, 1\) must be three finite numbers > 0"):
        timetable("zbv", 2, 2, 4, (1, 0, 1))


def test_v_placement():
    assert [chunks_of(r, 3, 2, "v") for r in range(3)] == [[0, 5], [1, 4], [2, 3]]
    assert [rank_of(c, 3, "v") for c in range(6)] == [0, 1, 2, 2, 1, 0]
    assert [rank_of(c, 3) for c in range(6)] == [0, 1, 2, 0, 1, 2]
    # DualPipeV's steady state pairs the forward of one chunk with the whole backward of the other.
    pairs = [slot for slot in rank_slots("dualpipev", 3, 2, 8, 1) if len(slot) == 3]
    assert pairs and all(s[0].op == "F" and (s[1].op, s[2].op) == ("B", "W") and s[1].chunk != s[0].chunk
                         and (s[1].chunk, s[1].mb) == (s[2].chunk, s[2].mb) for s in pairs)


def test_split_layers_even_uneven_and_refused():
    assert split_layers(8, 4) == (2, 2, 2, 2)
    assert split_layers(6, 4) == (1, 2, 2, 1)  # the remainder to the middle: the ends carry embedding/head
    assert split_layers(7, 2, 2) == (2, 2, 2, 1)  # middle first, then the lower end
    assert split_layers(4, 2, counts=[3, 1]) == (3, 1)
    assert split_layers(2, 3, counts=[0, 2, 0], ends_may_be_empty=True) == (0, 2, 0)
    with pytest.raises(ValueError, match="cannot split 3 layers into pp=2 x virtual_stages=2 = 4 chunks"):
        split_layers(3, 2, 2)
    with pytest.raises(ValueError, match=r"layer_counts=\[3, 2\] must be 2 integers"):
        split_layers(4, 2, counts=[3, 2])
    with pytest.raises(ValueError, match="chunk 1 would hold no layer"):
        split_layers(2, 3, counts=[1, 0, 1], ends_may_be_empty=True)


def test_gpt_chunks_compose_to_the_model_and_keep_its_names():
    torch.manual_seed(0)
    model = GPT(GPTConfig(num_layers=5))
    idx = torch.randint(0, 64, (2, 16))
    for pp, v in ((2, 1), (3, 1), (2, 2)):
        per_rank = [gpt_chunks(model, pp, r, v) for r in range(pp)]
        layout = per_rank[0][1]
        assert sum(layout.counts) == 5 and "embeddings" in layout.describe()
        chunks = [per_rank[c % pp][0][c // pp] for c in range(pp * v)]
        x = idx
        for c in chunks:
            x = c(x)
        assert torch.equal(x, model(idx))
        names = {n for c in chunks for n, _ in c.named_parameters()}
        assert names == {n for n, _ in model.named_parameters()}
    per_rank = [gpt_chunks(model, 3, r, 2, [1, 1, 1, 1, 1, 0], style="v")[0] for r in range(3)]  # rank 0: chunks 0, 5
    assert [[c.pipeline_chunk for c in cs] for cs in per_rank] == [[0, 5], [1, 4], [2, 3]]
    x = idx
    for c in range(6):
        x = per_rank[rank_of(c, 3, "v")][0 if c < 3 else 1](x)
    assert torch.equal(x, model(idx))
    with pytest.raises(ValueError, match="virtual_stages=1 must be 2"):
        gpt_chunks(model, 2, 0, 1, style="v")


def test_sequential_chunks_keep_the_sequential_names():
    seq = nn.Sequential(*[nn.Linear(4, 4) for _ in range(5)])
    chunks, layout = sequential_chunks(seq, 2, 1)
    assert layout.counts == (3, 2)
    assert [n for n, _ in chunks[0].named_parameters()] == ["3.weight", "3.bias", "4.weight", "4.bias"]
    x = torch.randn(3, 4)
    first, _ = sequential_chunks(seq, 2, 0)
    assert torch.equal(chunks[0](first[0](x)), seq(x))


def test_bubble_is_measured_apart_from_exposed_p2p():
    from overlapkit.pipeline_parallel import StepTiming, pipeline_times
    from overlapkit.timeline.report import measure
    from overlapkit.runtime.spans import Span

    spans = [Span("compute", "F0", "compute", 0, 10, step=1), Span("compute", "B0", "compute", 20, 40, step=1),
             Span("pp_bubble", "wait", "bubble", 10, 15, step=1), Span("pp_bubble", "wait", "bubble", 8, 12, step=1),
             Span("pp_recv", "", "comm", 14, 18, step=1), Span("pp_send", "", "comm", 30, 45, step=1)]
    t = measure(spans)
    assert t.bubble_ms == pytest.approx(5.0)  # [8, 15] less the compute up to 10
    assert t.comm_ms == pytest.approx(19.0) and t.exposed_comm_ms == pytest.approx(9.0)  # bubble-time p2p counts there
    timing = StepTiming(step=1, bubbles=[(10, 15), (8, 12)],
                        actions=[("F", 0, 0, 0, 10), ("B", 0, 0, 20, 40)])
    p = pipeline_times(spans, timing)
    # p2p outside compute and bubble: [15, 18] of the receive and [40, 45] of the send.
    assert (p.compute_ms, p.bubble_ms, p.p2p_ms, p.exposed_p2p_ms) == pytest.approx((30, 5, 19, 8))
    assert p.bubble_fraction == pytest.approx(5 / 30)
