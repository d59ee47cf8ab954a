"""on_trace_ready under torch.profiler's schedule, and TensorBoard scalars (optional dependency)."""

import io
import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, schedule

from overlapkit.timeline import Span, compute_span, on_trace_ready, report_spans, tensorboard_scalars


def test_on_trace_ready_writes_the_trace_and_reports_each_cycle(tmp_path):
    out = io.StringIO()
    handler = on_trace_ready(str(tmp_path), worker_name="rank0", stream=out)
    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=2, repeat=2),
                 on_trace_ready=handler) as prof:
        for _ in range(8):
            with compute_span("mm"):
                x @ x
            prof.step()
    traces = sorted(tmp_path.glob("rank0.*.pt.trace.json"))
    reports = sorted(tmp_path.glob("rank0.*.overlap.json"))
    assert len(traces) == 2 and len(reports) == 2  # one per cycle of the schedule
    doc = json.loads(reports[0].read_text())
    assert doc["ranks"][0]["n_steps"] == 2 and doc["ranks"][0]["compute_ms"] > 0
    lines = out.getvalue().strip().splitlines()
    assert len(lines) == 4 and all(line.startswith("overlapkit: rank 0 step ") for line in lines)
    assert handler.last_report.ranks[0].steps[-1][0] == 7  # the second cycle's steps are 6 and 7


class _Writer:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, tag, value, global_step):
        self.scalars.append((tag, value, global_step))

    def flush(self):
        pass


def test_tensorboard_scalars_per_step():
    spans = [Span("compute", "mm", "compute", 0, 10, step=3), Span("dp_all_reduce", "b", "comm", 6, 12, step=3)]
    w = _Writer()
    n = tensorboard_scalars(report_spans(spans), "unused", writer=w)
    got = {tag: (v, step) for tag, v, step in w.scalars}
    assert n == 7 and got["overlap/overlap_pct/rank0"] == (pytest.approx(100 * 4 / 6), 3)
    assert got["overlap/exposed_comm_ms/rank0"] == (pytest.approx(2.0), 3)


def test_tensorboard_missing_is_skipped_cleanly(tmp_path):
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.warns(UserWarning, match="tensorboard is not installed"):
            assert tensorboard_scalars(report_spans([Span("compute", "mm", "c", 0, 1, step=0)]), str(tmp_path)) == 0
    else:
        assert tensorboard_scalars(report_spans([Span("compute", "mm", "c", 0, 1, step=0)]), str(tmp_path)) > 0
