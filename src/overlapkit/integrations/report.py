"""The overlap report beside the loss: which communication of a training step no compute hid.

Nothing here overlaps anything. `OverlapReportCallback` records the engines' spans during the
step before each log (one step in `every`, so the other steps run without the recorder's host
cost) and `overlap_metrics` turns them into flat numbers a Trainer logs with the loss, so
`report_to` (TensorBoard, W&B, ...) plots exposed communication per kind next to it. The
numbers are this rank's (rank 0's in the logs a Trainer writes): no extra collective.
"""

from __future__ import annotations

import contextlib

from transformers import TrainerCallback

from ..runtime.recorder import record
from ..timeline.report import report_spans


def overlap_metrics(spans, prefix: str = "overlap/") -> dict[str, float]:
    """Per-step means of one rank's spans: comm_ms, exposed_comm_ms, overlap_pct and exposed ms per kind."""
    report = report_spans(spans)
    if not report.ranks:
        return {}
    rank = report.ranks[0]
    steps = max(1, len(rank.steps))
    out = {f"{prefix}comm_ms": rank.total.comm_ms / steps}
    if rank.total.exposed_comm_ms is not None:
        out[f"{prefix}exposed_comm_ms"] = rank.total.exposed_comm_ms / steps
    if rank.total.overlap_pct is not None:
        out[f"{prefix}overlap_pct"] = rank.total.overlap_pct
    for row in rank.by_kind:
        if row.exposed_ms is not None:
            out[f"{prefix}exposed_ms/{row.kind}"] = row.exposed_ms / steps
    return out


class OverlapReportCallback(TrainerCallback):
    """Record one optimizer step in `every` (None: the Trainer's `logging_steps`) and keep its metrics.

    `pop_metrics()` hands the metrics of the steps recorded since the last call (and forgets them).
    """

    def __init__(self, every: int | None = None, device=None) -> None:
        if every is not None and (not isinstance(every, int) or every < 1):
            raise ValueError(f"OverlapReportCallback every={every!r}: expected a positive int or None")
        self.every = every
        self.device = device
        self._stack: contextlib.ExitStack | None = None
        self._recorder = None
        self._metrics: list[dict[str, float]] = []

    def _period(self, args) -> int:
        if self.every is not None:
            return self.every
        steps = args.logging_steps
        return max(1, int(steps)) if steps >= 1 else 1

    def on_step_begin(self, args, state, control, **kwargs):
        if self._stack is None and (state.global_step + 1) % self._period(args) == 0:
            self._stack = contextlib.ExitStack()
            self._recorder = self._stack.enter_context(record(device=self.device or args.device))

    def on_step_end(self, args, state, control, **kwargs):
        self._stop()

    def on_train_end(self, args, state, control, **kwargs):
        self._stop()

    def _stop(self) -> None:
        if self._stack is None:
            return
        self._stack.close()
        # Each recorder has its own clock origin: a step's spans are measured alone, then averaged.
        self._metrics.append(overlap_metrics(self._recorder.spans))
        self._stack, self._recorder = None, None

    def pop_metrics(self) -> dict[str, float]:
        """The mean of each metric over the steps recorded since the last call; {} when none was."""
        metrics, self._metrics = self._metrics, []
        keys = sorted({k for m in metrics for k in m})
        return {k: sum(m[k] for m in metrics if k in m) / sum(k in m for m in metrics) for k in keys}
