"""A progress bar over the bytes of the traces being read (rich), for traces that take a while.

`Progress(files)` is what `read_traces(..., progress=)` feeds: one bar over the total size of
the files, advanced as each file is read (timeline/jsonstream.py reports the bytes consumed).
It draws to stderr, only when asked or when stderr is a terminal and the files are large. Where
stderr is not a terminal (a log, a pipe, CI), a live bar would show only once the read is done,
so there it writes plain lines instead: one as the read starts, then one at most every
LINE_EVERY_S seconds, and one at the end.
"""

from __future__ import annotations

import os
import sys
import time

AUTO_ABOVE_BYTES = 32 << 20
"""With no explicit choice, a bar is drawn for this many bytes of traces or more (on a terminal)."""
LINE_EVERY_S = 1.0
"""Off a terminal, a progress line at most this often."""


class Progress:
    def __init__(self, files, show: bool | None = None, stream=None) -> None:
        self.files = [str(f) for f in files]
        self.sizes = {f: _size(f) for f in self.files}
        self.total = sum(self.sizes.values())
        stream = stream or sys.stderr
        if show is None:
            show = self.total >= AUTO_ABOVE_BYTES and getattr(stream, "isatty", lambda: False)()
        self.bar, self.task, self.done = None, None, 0
        self.lines, self.stream, self.started, self.last_line = False, stream, time.monotonic(), 0.0
        if show and not getattr(stream, "isatty", lambda: False)():
            self.lines = True
        elif show:
            try:
                from rich.console import Console
                from rich.progress import BarColumn, DownloadColumn, Progress as Bar, TextColumn, TimeRemainingColumn
            except ImportError:
                return
            self.bar = Bar(TextColumn("reading traces"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                           console=Console(file=stream), transient=False)
            self.task = self.bar.add_task("read", total=self.total)

    def __enter__(self) -> "Progress":
        self.started = self.last_line = time.monotonic()
        if self.bar is not None:
            self.bar.start()
        if self.lines:
            self._line(f"reading {len(self.files)} trace(s), {self.total / 1e6:.1f} MB")
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=self.total)
            self.bar.stop()
        if self.lines and exc[0] is None:
            self._line(f"read {self.total / 1e6:.1f} MB in {time.monotonic() - self.started:.1f} s")

    def note(self, text: str) -> None:
        """One more line (off a terminal, when lines are on): what runs after the read, which has no bar."""
        if self.lines:
            self._line(text)

    def _line(self, text: str) -> None:
        print(f"overlapkit analyze: {text}", file=self.stream, flush=True)

    def feed(self, path):
        """The on_bytes callback for one file (files are read one after the other)."""
        base = sum(self.sizes[f] for f in self.files[:self.files.index(str(path))]) if str(path) in self.sizes else 0

        def on_bytes(n: int) -> None:
            self.done = base + n
            if self.bar is not None:
                self.bar.update(self.task, completed=self.done)
            elif self.lines and (now := time.monotonic()) - self.last_line >= LINE_EVERY_S:
                self.last_line = now
                self._line(f"read {self.done / 1e6:.1f} of {self.total / 1e6:.1f} MB "
                           f"({100 * self.done / max(1, self.total):.0f} %) in {now - self.started:.1f} s")
        return on_bytes


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
