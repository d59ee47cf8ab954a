"""What `overlapkit analyze` cannot read it refuses: one line naming the file, the event and the field, exit 2.

Each case was once a silent answer: a kernel with a null or missing dur dropped (communication 0.040 ms -> 0),
ts = 1e18 made the step 1e15 ms, dur = 1e15 µs gave 1e12 ms of communication, `dur: true` read as 1 µs, a rank
outside its world, `--what-if rank=7` on two ranks and `hide=bogus` answered "saves 0.000".
"""

import json
import math

import pytest

from kineto import TraceBuilder
from overlapkit.timeline import analyze, read_trace
from overlapkit.timeline.cli import main

NCCL = "ncclDevKernel_AllReduce_RING_LL(x)"


def _builder(rank=0, world=2):
    b = TraceBuilder(rank=rank, world_size=world)
    b.launch("gemm", 1000, 10, at=1000)
    b.launch(NCCL, 1005, 40, at=1001, stream=20)  # events 2 (launch) and 3 (the NCCL kernel)
    return b


def _run(path, *flags):
    return main([str(path), *flags])


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    return err


_MISSING = object()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field, value, problem", [
    ("dur", None, "has a null dur (null)"),
    ("dur", _MISSING, "has no dur"),
    ("dur", True, "has a boolean dur (true)"),
    ("ts", None, "has a null ts (null)"),
    ("ts", _MISSING, "has no ts"),
    ("ts", False, "has a boolean ts (false)"),
    ("dur", 1e15, "has dur 1e+15 µs"),
    ("ts", 1e18, "has ts 1e+18 µs, ending"),
    ("ts", -1e18, "has ts -1e+18 µs"),
])
def test_a_kernel_time_it_cannot_read_is_refused(tmp_path, capsys, monkeypatch, stream, field, value, problem):
    from overlapkit.timeline import jsonstream

    monkeypatch.setattr(jsonstream, "STREAM_ABOVE_BYTES", -1 if stream else 1 << 40)
    b = _builder()
    if value is _MISSING:
        del b.events[3][field]
    else:
        b.events[3][field] = value
    path = b.write(tmp_path / "bad.json")
    assert _run(path) == 2
    err = _one_line(capsys)
    assert str(path) in err and f"event 3 ('{NCCL}')" in err and problem in err, err


def test_the_earliest_event_is_named_when_it_is_the_one_far_away(tmp_path, capsys):
    b = _builder()
    b.events[1]["ts"] = -1e12  # a gemm 11 days before the rest
    assert _run(b.write(tmp_path / "early.json")) == 2
    err = _one_line(capsys)
    assert "event 1 ('gemm') has ts -1e+12 µs" in err and "days before" in err, err


def test_odd_fields_of_events_no_number_is_read_from_are_not_refused(tmp_path):
    good = _builder()
    odd = _builder()
    odd.events += [
        {"ph": "X", "cat": "python_function", "name": "train.py(10): step", "ts": None, "dur": True, "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": "my range", "ts": 1e18, "dur": None, "tid": 1},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "my range", "ts": True, "tid": 7},
        {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": 1, "ts": None},
    ]
    a, b = read_trace(good.write(tmp_path / "good.json")), read_trace(odd.write(tmp_path / "odd.json"))
    assert a.spans == b.spans and a.step_ranges == b.step_ranges


@pytest.mark.parametrize("event, what", [([1, 2], "a JSON array"), ("kernel", "a JSON string"),
                                         (None, "a JSON null"), (7, "a JSON number")])
def test_an_event_that_is_not_an_object_is_named(tmp_path, capsys, event, what):
    b = _builder()
    b.events.insert(2, event)
    path = b.write(tmp_path / "mixed.json")
    assert _run(path) == 2
    err = _one_line(capsys)
    assert str(path) in err and f"event 2 is {what}" in err and "not an event object" in err, err


@pytest.mark.parametrize("rank, world, problem", [
    (2, 2, "rank 2 is outside the world of 2 ranks (ranks 0..1)"),
    (0, 0, "distributedInfo.world_size is 0: a world size is an integer >= 1"),
    (0, -1, "distributedInfo.world_size is -1"),
    (0, "2", "distributedInfo.world_size is '2'"),
    (0, True, "distributedInfo.world_size is true"),
])
def test_a_rank_outside_its_world_is_refused(tmp_path, capsys, rank, world, problem):
    path = _builder(rank, world).write(tmp_path / "ranked.json")
    assert _run(path) == 2
    err = _one_line(capsys)
    assert str(path) in err and problem in err, err


def test_a_given_rank_outside_the_world_is_refused(tmp_path, capsys):
    path = _builder().write(tmp_path / "ranked.json")
    assert _run(path, "--rank", "5") == 2
    assert "rank 5 is outside the world of 2 ranks" in _one_line(capsys)


def _two_ranks(tmp_path):
    return [str(_builder(r).write(tmp_path / f"rank{r}.json")) for r in (0, 1)]


@pytest.mark.parametrize("question, problem", [
    ("rank=7", "the traces have no rank 7; their ranks: 0, 1"),
    ("hide=bogus", "the traces have no 'bogus' communication; their kinds: all_reduce"),
])
def test_a_what_if_about_something_the_traces_lack_is_refused(tmp_path, capsys, question, problem):
    assert main([*_two_ranks(tmp_path), "--what-if", question]) == 2
    err = _one_line(capsys)
    assert problem in err and question in err, err


def test_a_what_if_about_what_the_traces_hold_is_answered(tmp_path, capsys):
    assert main([*_two_ranks(tmp_path), "--what-if", "rank=1", "hide=all_reduce", "--json"]) == 0
    asked = json.loads(capsys.readouterr().out)["what_if_asked"]
    assert [q["question"] for q in asked] == ["rank 1 as fast as the median of the others", "all_reduce fully hidden"]


@pytest.mark.parametrize("peak", ["-5", "0", "nan", "inf"])
def test_a_peak_that_is_not_a_positive_finite_number_is_refused(tmp_path, capsys, peak):
    # refused before the trace is read: the trace does not even exist
    assert main([str(tmp_path / "nowhere.json"), "--peak-gbps", peak]) == 2
    err = _one_line(capsys)
    assert f"--peak-gbps {float(peak)!r}: a link's peak is a finite number of GB/s > 0" in err, err


@pytest.mark.parametrize("peak", [-5.0, 0, math.nan, math.inf, True])
def test_the_library_refuses_the_same_peaks(tmp_path, peak):
    trace = read_trace(_builder().write(tmp_path / "ok.json"))
    with pytest.raises(ValueError, match="a link's peak is a finite number of GB/s > 0"):
        analyze([trace], peak_gbps=peak)


def test_work_all_in_the_dropped_last_step_is_named_not_a_crash(tmp_path, capsys):
    # found by the fuzz test: a step moved before the others left nothing outside the last step, and the
    # report died on min() of nothing
    b = _builder()
    b.cpu("ProfilerStep#2", -1, 200)
    b.cpu("ProfilerStep#1", 990, 200)
    path = b.write(tmp_path / "steps.json")
    assert _run(path) == 2
    err = _one_line(capsys)
    assert "all work was issued in the last ProfilerStep (#1)" in err and "--last-step" in err, err
    assert _run(path, "--last-step") == 0
