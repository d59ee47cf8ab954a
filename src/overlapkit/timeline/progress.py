"""A progress bar over the bytes of the traces being read (rich), for traces that take a while.

`Progress(files)` is what `read_traces(..., progress=)` feeds: one bar over the total size of
the files, advanced as each file is read (timeline/jsonstream.py reports the bytes consumed).
It draws to stderr, only when asked or when stderr is a terminal and the files are large; without
rich it stays silent.
"""

from __future__ import annotations

import os
import sys

AUTO_ABOVE_BYTES = 32 << 20
"""With no explicit choice, a bar is drawn for this many bytes of traces or more (on a terminal)."""


class Progress:
    def __init__(self, files, show: bool | None = None, stream=None) -> None:
        self.files = [str(f) for f in files]
        self.sizes = {f: _size(f) for f in self.files}
        self.total = sum(self.sizes.values())
        stream = stream or sys.stderr
        if show is None:
            show = self.total >= AUTO_ABOVE_BYTES and getattr(stream, "isatty", lambda: False)()
        self.bar, self.task, self.done = None, None, 0
        if show:
            try:
                from rich.console import Console
                from rich.progress import BarColumn, DownloadColumn, Progress as Bar, TextColumn, TimeRemainingColumn
            except ImportError:
                return
            self.bar = Bar(TextColumn("reading traces"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                           console=Console(file=stream), transient=False)
            self.task = self.bar.add_task("read", total=self.total)

    def __enter__(self) -> "Progress":
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=self.total)
            self.bar.stop()

    def feed(self, path):
        """The on_bytes callback for one file (files are read one after the other)."""
        base = sum(self.sizes[f] for f in self.files[:self.files.index(str(path))]) if str(path) in self.sizes else 0

        def on_bytes(n: int) -> None:
            self.done = base + n
            if self.bar is not None:
                self.bar.update(self.task, completed=self.done)
        return on_bytes


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
