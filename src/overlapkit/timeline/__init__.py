"""What really overlapped: engine-side recording, profiler-trace reading, one report, one picture."""

from .recorder import Recorder, active, compute_span, record
from .spans import COMM_KINDS, COMPUTE, Span

__all__ = ["Recorder", "Span", "COMM_KINDS", "COMPUTE", "active", "compute_span", "record"]
