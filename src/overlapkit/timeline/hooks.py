"""Overlap reports straight from a running torch.profiler: how much communication compute hid, each cycle.

`on_trace_ready(dir)` is a `torch.profiler.profile(on_trace_ready=...)` handler: at the end of
every profiling cycle of a `torch.profiler.schedule` it writes the trace (named as
`tensorboard_trace_handler` names them, so HTA and `overlapkit analyze DIR` read the folder),
reads it back, prints the overlap summary and saves the report as JSON beside the trace, and,
with `tensorboard=LOGDIR`, logs the per-step numbers as TensorBoard scalars.

    from torch.profiler import profile, schedule
    from overlapkit.timeline import on_trace_ready
    with profile(schedule=schedule(wait=1, warmup=1, active=3), on_trace_ready=on_trace_ready("traces")) as p:
        for batch in loader:
            train_step(batch); p.step()
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import warnings

SCALARS = ("step_ms", "compute_ms", "comm_ms", "exposed_comm_ms", "overlap_pct", "idle_ms", "t_last_ms")
"""Per-step fields logged as TensorBoard scalars `overlap/<field>/rank<r>`."""


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def tensorboard_scalars(report, log_dir: str, writer=None) -> int:
    """Log each rank's per-step numbers as scalars (global step = ProfilerStep number); returns how many.

    Needs `tensorboard` (an optional dependency): without it, warns once and logs nothing (returns 0).
    """
    if writer is None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # torch raises ImportError when the tensorboard package is missing
            warnings.warn("tensorboard is not installed: no TensorBoard scalars written (pip install tensorboard)")
            return 0
        writer = SummaryWriter(log_dir=log_dir)
    n = 0
    for row in report.ranks:
        for step, times in row.steps:
            for name in SCALARS:
                value = getattr(times, name)
                if value is not None:
                    writer.add_scalar(f"overlap/{name}/rank{row.rank}", value, global_step=step)
                    n += 1
    writer.flush()
    return n


def on_trace_ready(dir_name: str, *, worker_name: str | None = None, print_summary: bool = True,
                   save_json: bool = True, tensorboard: str | None = None, stream=None):
    """A torch.profiler `on_trace_ready` handler that writes the trace and reports its overlap.

    The trace goes to `dir_name/<worker>.<ms>.pt.trace.json` (worker: `rank<R>_<host>_<pid>`);
    the report to the same name with `.overlap.json` (`save_json`); a one-line summary per step
    to `stream` (stderr by default; `print_summary=False` for none); scalars to `tensorboard`.
    Each call (each profiling cycle) reports that cycle's steps. Returns the handler.
    """
    os.makedirs(dir_name, exist_ok=True)

    def handler(prof) -> None:
        from .report import report_traces
        from .trace import TraceError, read_trace

        rank = _rank()
        worker = worker_name or f"rank{rank}_{socket.gethostname()}_{os.getpid()}"
        path = os.path.join(dir_name, f"{worker}.{int(time.time() * 1000)}.pt.trace.json")
        prof.export_chrome_trace(path)
        try:
            trace = read_trace(path, rank=rank, last_step=True)  # a schedule's cycle ends at its last step
        except TraceError as e:
            print(f"overlapkit: {e}", file=stream or sys.stderr)
            return
        report = report_traces([trace])
        handler.last_report = report
        if save_json:
            with open(path[: -len(".pt.trace.json")] + ".overlap.json", "w") as f:
                json.dump(report.to_dict(), f, indent=2)
        if print_summary:
            for n, t in report.ranks[0].steps:
                pct = "unknown" if t.overlap_pct is None else f"{t.overlap_pct:.1f}%"
                exposed = "unknown" if t.exposed_comm_ms is None else f"{t.exposed_comm_ms:.2f} ms"
                print(f"overlapkit: rank {rank} step {n}: {t.step_ms:.2f} ms, comm {t.comm_ms:.2f} ms, "
                      f"exposed {exposed}, overlap {pct}", file=stream or sys.stderr)
        if tensorboard:
            tensorboard_scalars(report, tensorboard)

    handler.last_report = None
    return handler
