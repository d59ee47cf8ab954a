"""The picture and the Perfetto trace of recorded spans."""

import json

import pytest

from overlapkit.timeline import Span, plot_spans, write_chrome_trace


def _spans():
    return [Span("compute", "fc1", "compute", 0, 10, rank=r) for r in (0, 1)] + [
        Span("tp_all_gather", "fc1", "comm", 2, 6, rank=0, nbytes=64, group_size=2, step=0),
        Span("dp_all_reduce", "bucket0", "comm", 8, 14, rank=1, nbytes=64, group_size=2, step=0)]


def test_plot_writes_a_picture(tmp_path):
    path = plot_spans(_spans(), tmp_path / "timeline.png", title="two ranks")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_chrome_trace_has_a_process_per_rank_a_thread_per_stream_and_the_exposed_time(tmp_path):
    doc = json.loads(write_chrome_trace(_spans(), tmp_path / "t.json").read_text())
    ev = doc["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in ev if e["name"] == "process_name"}
    assert procs == {0: "rank 0", 1: "rank 1"}
    threads = {(e["pid"], e["args"]["name"]) for e in ev if e["name"] == "thread_name"}
    assert (1, "comm") in threads and (1, "exposed comm") in threads
    ar = next(e for e in ev if e.get("cat") == "dp_all_reduce")
    assert (ar["ts"], ar["dur"], ar["args"]["bytes"]) == (8000, 6000, 64)  # µs
    exposed = [(e["pid"], e["ts"], e["dur"]) for e in ev if e.get("cat") == "exposed"]
    assert exposed == [(1, pytest.approx(10000), pytest.approx(4000))]  # rank 0's gather is hidden
