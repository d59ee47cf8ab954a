"""What really overlapped: engine-side recording, profiler-trace reading, one report, one picture.

Names load on first use (PEP 562): reading a trace or drawing needs no torch import.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "Recorder": "..runtime.recorder", "active": "..runtime.recorder", "comm_range": "..runtime.recorder",
    "compute_span": "..runtime.recorder", "record": "recording", "Recording": "recording",
    "Span": "..runtime.spans", "COMM_KINDS": "..runtime.spans", "COMPUTE": "..runtime.spans",
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
    where = _WHERE[name]
    module = importlib.import_module(where, __name__) if where.startswith(".") else \
        importlib.import_module(f"{__name__}.{where}")
    return getattr(module, name)
