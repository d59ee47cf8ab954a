"""`overlapkit plan`'s pricing of the pipeline schedules (costmodel.schedule) agrees with the engine's
timetable run with the same durations: the bubble of every schedule at F = B = W, ZB-H1's at any
costs, the activations and kept weight-gradient inputs at their peak; and the plan prints them."""

import json

import pytest

from overlapkit.cli import main
from overlapkit.costmodel.schedule import PIPELINE_SCHEDULES, pipeline_bubble_ms, pipeline_memory
from overlapkit.pipeline_parallel import price, timetable

ENGINE = {"1f1b": ("1f1b", 1), "interleaved": ("interleaved-1f1b", 2), "zb1p": ("zb1p", 1), "zbv": ("zbv", 2),
          "dualpipev": ("dualpipev", 2)}


def _timetable_cost(s: str, pp: int, m: int, f: float, b: float, w: float):
    name, v = ENGINE[s]
    split = name in ("zb1p", "zbv", "dualpipev")
    t = timetable(name, pp, v, m, (f, b, w))
    return price(t, f / v, (b if split else b + w) / v, w / v if split else None)


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_priced_bubble_equals_the_timetable(pp):
    m = 4 * pp
    for s in PIPELINE_SCHEDULES:
        cost = _timetable_cost(s, pp, m, 1.0, 1.0, 1.0)
        idle = max(cost.step - b for b in cost.busy)
        assert pipeline_bubble_ms(s, pp, 1.0, 1.0, 1.0) == pytest.approx(idle), s
    for f, b, w in ((1.0, 1.5, 1.0), (2.0, 1.0, 1.0), (1.0, 0.5, 1.5), (1.0, 1.2, 0.8)):
        for s in ("1f1b", "zb1p"):
            cost = _timetable_cost(s, pp, m, f, b, w)
            assert pipeline_bubble_ms(s, pp, f, b, w) == pytest.approx(max(cost.step - x for x in cost.busy)), s
        # ZB-V's price is the floor its warm-up leaves; with other costs the timetable's order never beats it.
        cost = _timetable_cost("zbv", pp, m, f, b, w)
        assert pipeline_bubble_ms("zbv", pp, f, b, w) <= max(cost.step - x for x in cost.busy) + 1e-9


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_priced_memory_is_what_the_timetable_holds(pp):
    for s in PIPELINE_SCHEDULES:
        name, v = ENGINE[s]
        acts, kept = pipeline_memory(s, pp)
        cost = _timetable_cost(s, pp, 2 * pp, 1.0, 1.0, 1.0)
        assert max(cost.peak_alive) / v == pytest.approx(acts), s  # the timetable counts chunks
        if s == "zbv":
            assert max(cost.peak_kept_w) / v <= kept
        else:
            assert max(cost.peak_kept_w) / v == pytest.approx(kept), s


def test_plan_prints_every_schedule(capsys):
    args = ["plan", "--model", "llama3-8b", "--tp", "2", "--pp", "4", "--dp", "1", "--global-batch", "8"]
    assert main(args + ["--json"]) == 0
    rows = {r["schedule"]: r for r in json.loads(capsys.readouterr().out)["pipeline_schedules"]}
    assert list(rows) == list(PIPELINE_SCHEDULES)
    assert rows["1f1b"]["bubble_vs_1f1b"] == 1.0
    assert rows["zbv"]["bubble_vs_1f1b"] < rows["zb1p"]["bubble_vs_1f1b"] < 1.0
    assert rows["1f1b"]["kept_w_gib"] == 0 < rows["dualpipev"]["kept_w_gib"] == rows["zb1p"]["kept_w_gib"] / 2
    f, b, w = (rows["zb1p"][k] for k in ("f_ms", "b_ms", "w_ms"))
    assert rows["zb1p"]["bubble_s"] == pytest.approx(3 * max(f, f + b - w) * 1e-3)
    assert main(args) == 0
    assert "pipeline schedules (a stage's micro-batch" in capsys.readouterr().out
