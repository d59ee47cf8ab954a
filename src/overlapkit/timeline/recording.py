"""A recording of this rank's overlap that reports and draws itself: `with record() as rec: ...; rec.report()`.

The engines stamp their GEMMs and collectives into the runtime's `Recorder`; this subclass adds the
two things a user does next with it, so that the first lines of a training script end in one call
instead of composing `print_report(report_spans(rec.spans))`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from ..runtime import recorder as runtime_recorder
from .report import Report, report_spans
from .table import print_report


class Recording(runtime_recorder.Recorder):
    """The spans of one rank, with `report()` and `plot(path)`; read them after `record()` exits."""

    def report(self, *, show: bool = True, detail: bool = True) -> Report:
        """The overlap report of the recorded spans (communication, exposed, overlap % per kind and
        stream); printed as tables unless `show=False`."""
        report = report_spans(self.spans)
        if show:
            print_report(report, detail=detail)
        return report

    def plot(self, path: str | Path, title: str | None = None) -> Path:
        """Draw the recorded spans to `path` (lanes per stream, exposed communication in red)."""
        from .plot import plot_spans  # matplotlib loads only for a picture

        return plot_spans(self.spans, path, title)


@contextlib.contextmanager
def record(rank: int | None = None, device=None) -> Iterator[Recording]:
    """Record every engine's spans on this rank while the block runs; yields a `Recording`.

    `device` picks the clock: a CUDA device records CUDA events, anything else the host clock.
    """
    with runtime_recorder.record(rank, device, recorder=Recording) as rec:
        yield rec
