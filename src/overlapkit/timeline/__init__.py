"""What really overlapped: engine-side recording, profiler-trace reading, one report, one picture.

Names load on first use (PEP 562): reading a trace or drawing needs no torch import.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "Recorder": "recorder", "active": "recorder", "comm_range": "recorder", "compute_span": "recorder",
    "record": "recorder",
    "Span": "spans", "COMM_KINDS": "spans", "COMPUTE": "spans",
    "plot_spans": "plot", "write_chrome_trace": "plot",
    "Report": "report", "report_spans": "report", "report_traces": "report",
    "print_report": "table",
    "Trace": "trace", "TraceError": "trace", "read_trace": "trace", "read_traces": "trace",
    "on_trace_ready": "hooks", "tensorboard_scalars": "hooks",
    "Analysis": "diagnose", "analyze": "diagnose", "walk": "diagnose",
    "critical_paths": "critical_path", "Job": "framework", "compare": "compare", "write_html": "html",
}

__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'overlapkit.timeline' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
