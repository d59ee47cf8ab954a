"""Fuzz: one field of one event of a good trace made odd; `analyze` answers as before or refuses in one line
naming that event, never a number read from the odd value."""

import json
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kineto import TraceBuilder
from overlapkit.timeline.cli import main

ODD = [None, True, False, "soon", math.nan, math.inf, -math.inf, -1.0, 1e15, 1e18, -1e18, [1], {"a": 1}]
"""Values no time can be read from: each must be refused when it sits on an event the reader uses."""


def _trace() -> TraceBuilder:
    b = TraceBuilder()
    b.cpu("ProfilerStep#1", 990, 200)
    b.cpu("ProfilerStep#2", 1190, 200)
    for k, t in enumerate((1000, 1200)):
        b.launch("gemm", t, 30, at=t)
        b.launch("ncclDevKernel_AllReduce_RING_LL(x)", t + 10, 40, at=t + 1, stream=20)
        b.cpu("aten::mm", t - 2, 5, cat="cpu_op")
    return b


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(index=st.integers(0, 11), field=st.sampled_from(["ts", "dur"]), value=st.sampled_from(ODD + ["missing"]))
def test_an_odd_time_is_refused_by_event_and_field_or_changes_nothing(tmp_path_factory, capsys, index, field, value):
    folder = tmp_path_factory.mktemp("fuzz")
    good = _trace().write(folder / "good.json")
    assert main([str(good), "--json"]) == 0
    expected = json.loads(capsys.readouterr().out)["ranks"]
    b = _trace()
    event = b.events[index]
    if value == "missing":
        event.pop(field, None)
    else:
        event[field] = value
    path = b.write(folder / "odd.json")
    code = main([str(path), "--json"])
    captured = capsys.readouterr()
    if code == 0:  # only a value the reader can use, such as ts = -1 (earlier, but a time)
        assert value == -1.0 and field == "ts", (index, field, value, expected)
        return
    err = captured.err.strip()
    assert code == 2 and err.count("\n") == 0 and str(path) in err, err
    if value == -1.0 and field == "ts":  # a real time that moves a step: a named error of its own, never a crash
        assert "min() arg" not in err and "empty" not in err, err
        return
    assert f"event {index} (" in err, (index, field, value, err)
