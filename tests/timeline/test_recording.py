"""`record()` yields a recording that reports and draws itself, and leaves no recorder behind."""

import time

import pytest

from overlapkit.runtime import recorder as runtime_recorder
from overlapkit.timeline import Recording, compute_span, record, report_spans


def _recorded():
    with record(rank=0) as rec:
        t0 = rec.now()
        with compute_span("gemm"):
            time.sleep(0.02)
        rec.record_span("tp_all_gather", "ag", "comm", t0, rec.now())  # half under the GEMM, none beyond
    return rec


def test_report_is_the_report_of_its_spans_and_prints(capsys):
    rec = _recorded()
    assert isinstance(rec, Recording) and runtime_recorder.active() is None
    report = rec.report()
    printed = capsys.readouterr().out
    assert report == report_spans(rec.spans)
    assert "tp_all_gather" in printed and "overlap" in printed
    assert rec.report(show=False) == report and capsys.readouterr().out == ""
    (row,) = report.ranks
    assert row.total.comm_ms > 0 and row.total.compute_ms > 0


def test_plot_draws_to_the_path(tmp_path):
    out = _recorded().plot(tmp_path / "t.png")
    assert out.exists() and out.stat().st_size > 1000


def test_one_recorder_at_a_time_and_none_after_an_error():
    with pytest.raises(ValueError):
        with record():
            with pytest.raises(RuntimeError, match="already active"):
                with record():
                    pass
            raise ValueError("inside")
    assert runtime_recorder.active() is None
