"""The one record every timeline source produces: a span of communication or computation.

The engine-side recorder and the profiler-trace reader both turn what they saw into `Span`s,
so the report and the picture have one input, whatever the source.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

COMM_KINDS = (
    "tp_all_gather",
    "tp_reduce_scatter",
    "tp_all_reduce",
    "dp_all_reduce",
    "dp_reduce_scatter",
    "zero_all_gather",
    "zero_reduce_scatter",
    "pp_send",
    "pp_recv",
    "ep_all_to_all",
    "ep_dispatch",
    "ep_combine",
    "cp_kv",
)
"""Kinds of communication the engines record (trace readers may add NCCL collective names)."""

COMPUTE = "compute"
"""The kind of every computation span."""

OTHER_KINDS = ("memcpy", "memset", "pp_bubble")
"""Spans that are neither compute nor communication (trace memcpy/memset; pp_bubble, a pipeline stage
waiting for a neighbour that has not sent yet, recorded by the pipeline engine): shown, not counted."""


COMM_RANGE_PREFIX = "overlapkit.comm."
"""Profiler ranges named `overlapkit.comm.<kind>` or `overlapkit.comm.<kind>:<name>` mark transfers."""
COMPUTE_RANGE_PREFIX = "overlapkit.compute."
"""Profiler ranges named `overlapkit.compute.<name>` mark computations."""
WAIT_RANGE = "overlapkit.wait"
"""Profiler range around a host wait for communication: inside a compute range it is not compute."""


@dataclass(frozen=True)
class Span:
    """One interval on one stream of one rank."""

    kind: str
    """`compute`, one of COMM_KINDS, a collective name from a trace, or memcpy/memset."""
    name: str
    """What ran: a GEMM or layer name, a kernel name."""
    stream: str
    """The lane it ran on: 'compute', 'comm', a CUDA stream id, 'host'."""
    start_ms: float
    """Start, milliseconds from the source's origin."""
    end_ms: float
    """End, milliseconds from the source's origin; >= start_ms."""
    rank: int = 0
    """Global rank that ran it."""
    nbytes: int = 0
    """Bytes this rank sent or received for communication (message size); 0 for compute."""
    group_size: int = 1
    """Ranks taking part in the communication."""
    step: int | None = None
    """Training step it belongs to, when known."""
    phase: str | None = None
    """forward, backward, optimizer or pipeline bubble (see timeline/phases.py), when known."""
    group: str = ""
    """The process group's ranks as the trace names them (e.g. '[0, 1]'); '' when unknown."""

    @property
    def is_comm(self) -> bool:
        return self.kind != COMPUTE and self.kind not in OTHER_KINDS

    @property
    def is_compute(self) -> bool:
        return self.kind == COMPUTE

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms

    def shifted(self, offset_ms: float) -> "Span":
        return replace(self, start_ms=self.start_ms - offset_ms, end_ms=self.end_ms - offset_ms)
