"""The report's numbers on constructed timelines whose answers are known by hand."""

import io
import json

import pytest

from overlapkit.timeline import Span, report_spans
from overlapkit.timeline.report import measure
from overlapkit.timeline.table import plain_text, print_report


def comp(a, b, stream="compute", rank=0, step=None, name="gemm"):
    return Span("compute", name, stream, a, b, rank=rank, step=step)


def comm(a, b, kind="dp_all_reduce", stream="comm", rank=0, step=None, nbytes=1024):
    return Span(kind, "x", stream, a, b, rank=rank, nbytes=nbytes, group_size=2, step=step)


def test_fully_hidden():
    t = measure([comp(0, 10), comm(2, 6)])
    assert (t.comm_ms, t.hidden_ms, t.exposed_comm_ms, t.overlap_pct) == (4, 4, 0, 100)
    assert (t.step_ms, t.compute_ms, t.idle_ms, t.t_last_ms) == (10, 10, 0, 0)


def test_fully_exposed_comm_after_compute_is_the_tail():
    t = measure([comp(0, 5), comm(5, 8)])  # touching: no shared instant
    assert (t.comm_ms, t.exposed_comm_ms, t.overlap_pct, t.t_last_ms) == (3, 3, 0, 3)
    assert t.step_ms == 8 and t.idle_ms == 0


def test_partly_hidden_with_idle_gap_and_tail():
    # compute 0-4 and 6-8; comm 3-7 and 9-10: hidden 3-4 and 6-7, idle 8-9, tail 9-10
    t = measure([comp(0, 4), comp(6, 8), comm(3, 7), comm(9, 10)])
    assert t.comm_ms == 5 and t.hidden_ms == 2 and t.exposed_comm_ms == 3
    assert t.overlap_pct == pytest.approx(40.0)
    assert t.idle_ms == 1 and t.t_last_ms == 1 and t.step_ms == 10


def test_nested_and_overlapping_spans_count_once():
    # two comm streams overlapping each other and a nested compute span
    t = measure([comp(0, 10), comp(2, 3, name="inner"), comm(8, 12, stream="c1"), comm(9, 14, stream="c2")])
    assert t.compute_ms == 10 and t.comm_ms == 6 and t.hidden_ms == 2 and t.exposed_comm_ms == 4
    assert t.t_last_ms == 4


def test_compute_on_several_streams_hides_comm_together():
    # neither compute stream covers 0-10 alone; together they do
    t = measure([comp(0, 6, stream="s1"), comp(5, 10, stream="s2"), comm(0, 10)])
    assert t.exposed_comm_ms == 0 and t.overlap_pct == 100


def test_memcpy_is_neither_compute_nor_comm():
    t = measure([Span("memcpy", "Memcpy DtoD", "s", 0, 10), comm(0, 4)])
    assert t.compute_ms == 0 and t.comm_ms == 4 and t.exposed_comm_ms == 4 and t.idle_ms == 0
    assert t.t_last_ms == 4  # no compute at all: every transfer is tail


def test_no_comm_has_no_overlap_ratio():
    assert measure([comp(0, 1)]).overlap_pct is None
    assert measure([]).step_ms == 0


def test_breakdowns_by_kind_size_stream_and_step():
    spans = [comp(0, 10, step=0), comm(0, 4, "tp_all_gather", "ag", step=0, nbytes=100),
             comm(8, 12, "dp_all_reduce", step=0, nbytes=300), comp(20, 25, step=1),
             comm(24, 30, "dp_all_reduce", step=1, nbytes=300), comm(21, 22, "dp_all_reduce", step=1, nbytes=50)]
    r = report_spans(spans).ranks[0]
    kinds = {k.kind: k for k in r.by_kind}
    assert kinds["tp_all_gather"].exposed_ms == 0 and kinds["tp_all_gather"].overlap_pct == 100
    ar = kinds["dp_all_reduce"]
    assert (ar.count, ar.nbytes, ar.comm_ms, ar.exposed_ms) == (3, 650, 11, 7)
    sizes = {(k.kind, k.nbytes): (k.count, k.comm_ms, k.exposed_ms) for k in r.by_size}
    assert sizes[("dp_all_reduce", 300)] == (2, 10, 7) and sizes[("dp_all_reduce", 50)] == (1, 1, 0)
    streams = {s.stream: s for s in r.by_stream}
    assert streams["comm"].comm_ms == 11 and streams["comm"].exposed_ms == 7
    assert streams["ag"].exposed_ms == 0 and streams["compute"].compute_ms == 15
    steps = dict(r.steps)
    assert steps[0].step_ms == 12 and steps[0].exposed_comm_ms == 2 and steps[0].t_last_ms == 2
    assert steps[1].step_ms == 10 and steps[1].exposed_comm_ms == 5 and steps[1].t_last_ms == 5
    assert r.step_ms == 11  # the mean step
    assert r.total.step_ms == 30 and r.total.idle_ms == 30 - 10 - 2 - 5 - 5


def test_several_ranks_name_the_slowest_and_json_has_the_fields():
    spans = [comp(0, 10, rank=0), comm(0, 5, rank=0), comp(0, 10, rank=1), comm(5, 20, rank=1)]
    report = report_spans(spans)
    assert report.slowest.rank == 1
    doc = json.loads(report.to_json())
    assert doc["slowest_rank"] == 1
    r1 = doc["ranks"][1]
    for key in ("rank", "comm_ms", "exposed_comm_ms", "overlap_pct", "compute_ms", "step_ms", "by_kind"):
        assert key in r1
    assert r1["exposed_comm_ms"] == 10 and r1["by_kind"]["dp_all_reduce"]["exposed_ms"] == 10
    assert doc["ranks"][0]["overlap_pct"] == 100
    text = plain_text(report)
    assert "slowest rank: 1" in text and "dp_all_reduce" in text


def test_rich_table_prints_the_numbers():
    from rich.console import Console

    out = io.StringIO()
    print_report(report_spans([comp(0, 10), comm(5, 15)]), console=Console(file=out, width=200))
    text = out.getvalue()
    assert "50.0" in text and "dp_all_reduce" in text  # overlap % and the kind
