"""`overlapkit analyze` on bad input: one line naming the file and the problem, exit code 2."""

import gzip
import json
import subprocess
import sys

import pytest

from kineto import TraceBuilder
from overlapkit.timeline.cli import main


def _gpu_trace(tmp_path, rank=True):
    b = TraceBuilder()
    b.launch("gemm", 0, 10, at=0)
    b.launch("ncclDevKernel_AllReduce_RING_LL(x)", 5, 10, at=1, stream=20)
    return b.write(tmp_path / ("ok.json" if rank else "no_rank.json"), rank=rank)


def _not_a_trace(tmp_path):
    p = tmp_path / "notes.txt"
    p.write_text("hello, not json")
    return p, "not a trace: not JSON"


def _json_not_a_trace(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"lr": 0.1}))
    return p, "not a trace: no traceEvents"


def _truncated_gzip(tmp_path):
    data = gzip.compress(json.dumps(TraceBuilder().doc()).encode() + b" " * 4000)
    p = tmp_path / "cut.json.gz"
    p.write_bytes(data[: len(data) // 2])
    return p, "truncated or corrupt gzip"


def _nothing_in_it(tmp_path):
    b = TraceBuilder()
    b.cpu("ProfilerStep#1", 0, 10)  # a step, and no work of any kind inside it
    return b.write(tmp_path / "empty.json"), "nothing to analyze"


def _no_rank(tmp_path):
    return _gpu_trace(tmp_path, rank=False), "no rank"


def _missing(tmp_path):
    return tmp_path / "nowhere.json", "cannot read"


@pytest.mark.parametrize("case", [_not_a_trace, _json_not_a_trace, _truncated_gzip, _nothing_in_it, _no_rank,
                                  _missing])
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys, case):
    path, problem = case(tmp_path)
    assert main([str(_gpu_trace(tmp_path)), str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(path) in err and problem in err, err


def test_a_good_trace_prints_the_report(tmp_path, capsys):
    assert main([str(_gpu_trace(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "all_reduce" in out and "50.0" in out  # half the all-reduce ran under the GEMM


def test_the_rank_can_be_given_for_one_trace(tmp_path, capsys):
    path = _gpu_trace(tmp_path, rank=False)
    assert main([str(path), "--rank", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ranks"][0]["rank"] == 3
    assert main([str(path), str(path), "--rank", "3"]) == 2


def test_the_command_line_prints_no_traceback(tmp_path):
    path, _ = _truncated_gzip(tmp_path)
    run = subprocess.run([sys.executable, "-m", "overlapkit.timeline.cli", str(path)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2
    assert "Traceback" not in run.stderr and run.stderr.strip().count("\n") == 0, run.stderr


def test_the_same_trace_twice_is_refused(tmp_path, capsys):
    path = _gpu_trace(tmp_path)
    assert main([str(path), str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "rank 0 appears twice" in err and err.count("\n") == 0


def test_traces_of_different_jobs_are_refused(tmp_path, capsys):
    a, b = TraceBuilder(rank=0, world_size=2), TraceBuilder(rank=1, world_size=4)
    for t in (a, b):
        t.launch("gemm", 0, 10, at=0)
    assert main([str(a.write(tmp_path / "a.json")), str(b.write(tmp_path / "b.json"))]) == 2
    assert "world sizes ['2', '4'] differ" in capsys.readouterr().err
    c, d = TraceBuilder(rank=0), TraceBuilder(rank=1)
    for t, job in ((c, "job-a"), (d, "job-b")):
        t.launch("gemm", 0, 10, at=0)
        doc = t.doc()
        doc["group_trace_id"] = job
        (tmp_path / f"{job}.json").write_text(json.dumps(doc))
    assert main([str(tmp_path / "job-a.json"), str(tmp_path / "job-b.json")]) == 2
    assert "job ids ['job-a', 'job-b'] differ" in capsys.readouterr().err
    e, f = TraceBuilder(rank=0), TraceBuilder(rank=1, base_ns=1_800_000_000_000_000_000)  # years later
    for t in (e, f):
        t.launch("gemm", 0, 10, at=0)
    assert main([str(e.write(tmp_path / "e.json")), str(f.write(tmp_path / "f.json"))]) == 2
    assert "never overlap in time" in capsys.readouterr().err


def test_a_non_numeric_timestamp_is_one_line(tmp_path, capsys):
    b = TraceBuilder()
    b.launch("gemm", 0, 10, at=0)
    b.events[-1]["ts"] = "soon"
    assert main([str(b.write(tmp_path / "bad_ts.json"))]) == 2
    err = capsys.readouterr().err.strip()
    assert "non-numeric ts: 'soon'" in err and "bad_ts.json" in err and err.count("\n") == 0


def test_an_unsupported_picture_format_fails_before_any_work(tmp_path, capsys):
    # the trace does not exist: the format is refused first, so nothing is read
    assert main([str(tmp_path / "nowhere.json"), "--plot", str(tmp_path / "t.bmpx")]) == 2
    err = capsys.readouterr().err
    assert "cannot draw to this format" in err and "nowhere" not in err


def test_picture_labels_are_unique(tmp_path):
    from overlapkit.timeline import read_trace
    from overlapkit.timeline.cli import plot_labels

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    paths = []
    for d in ("a", "b"):
        t = TraceBuilder(rank=0)
        t.launch("gemm", 0, 10, at=0)
        paths.append(t.write(tmp_path / d / "rank0.json"))
    traces = [read_trace(p) for p in paths] + [read_trace(paths[0])]
    labels = plot_labels(traces)
    assert len(labels) == 3 and "rank 0 (b/rank0)" in labels  # no trace silently dropped


def test_a_directory_is_read_as_its_traces(tmp_path, capsys):
    d = tmp_path / "traces"
    d.mkdir()
    for rank in (0, 1):
        b = TraceBuilder(rank=rank)
        b.launch("gemm", 0, 10, at=0)
        b.launch("ncclDevKernel_AllReduce_RING_LL(x)", 5, 10, at=1, stream=20)
        b.write(d / f"rank{rank}.pt.trace.json.gz", gz=True)
    (d / "notes.txt").write_text("not a trace")
    assert main([str(d), "--json"]) == 0
    assert [r["rank"] for r in json.loads(capsys.readouterr().out)["ranks"]] == [0, 1]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([str(empty)]) == 2
    assert "no .json or .json.gz trace" in capsys.readouterr().err


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field, value, problem", [("ts", float("nan"), "a NaN or infinite ts"),
                                                   ("ts", float("inf"), "a NaN or infinite ts"),
                                                   ("dur", -5.0, "a negative dur (-5 µs)"),
                                                   ("dur", float("nan"), "a NaN or infinite dur")])
def test_corrupt_times_are_one_line_errors(tmp_path, capsys, monkeypatch, stream, field, value, problem):
    # NaN times once changed communication 19.8 -> 11.3 ms and negative durations zeroed compute, silently
    from overlapkit.timeline import jsonstream

    monkeypatch.setattr(jsonstream, "STREAM_ABOVE_BYTES", -1 if stream else 1 << 40)
    b = TraceBuilder()
    b.launch("gemm", 0, 10, at=0)
    b.launch("ncclDevKernel_AllReduce_RING_LL(x)", 5, 10, at=1, stream=20)
    b.events[-1][field] = value
    assert main([str(b.write(tmp_path / "bad.json"))]) == 2
    err = capsys.readouterr().err.strip()
    assert problem in err and "bad.json" in err and "ncclDevKernel_AllReduce" in err and err.count("\n") == 0, err


def test_a_negative_rank_is_refused(tmp_path, capsys):
    assert main([str(_gpu_trace(tmp_path, rank=False)), "--rank", "-3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "rank -3: a rank is an integer >= 0" in err and err.count("\n") == 0
