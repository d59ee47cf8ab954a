"""What really overlapped: engine-side recording, profiler-trace reading, one report, one picture."""

from .plot import plot_spans, write_chrome_trace
from .recorder import Recorder, active, comm_range, compute_span, record
from .report import Report, report_spans, report_traces
from .spans import COMM_KINDS, COMPUTE, Span
from .table import print_report
from .trace import Trace, TraceError, read_trace, read_traces

__all__ = ["Recorder", "Span", "COMM_KINDS", "COMPUTE", "active", "comm_range", "compute_span", "record",
           "Report", "report_spans", "report_traces", "print_report", "plot_spans", "write_chrome_trace",
           "Trace", "TraceError", "read_trace", "read_traces"]
