"""Engine-side recording of when communication and computation really ran.

While `record()` is active, every overlapkit engine stamps its GEMMs (`compute_span`) and its
collectives (`comm_issued` / `comm_done`, called by `overlapkit.runtime.comm`). On CUDA the stamps are
events on the stream where the work runs, resolved after a synchronize; on CPU host clocks at issue
and at completion (a `Work` future callback, or a watcher thread for gloo works that have no
future). When nothing records, each hook is one attribute read: nothing measurable.

While a torch.profiler runs, the same hooks also open profiler ranges named
`overlapkit.comm.<kind>[:name]` (around the issue of a transfer, `comm_range`) and
`overlapkit.compute.<name>` (around a computation), so that the trace reader can tell which
kernels and copies belong to which kind of transfer, even those no name-based tool knows
(symmetric-memory copy-engine pulls). `wait_range` marks a host wait (`overlapkit.wait`), so a
reader carves it out of an enclosing compute range as the recorder does.

The active recorder is process-wide (not a context variable) on purpose: autograd runs
backward on its own threads for CUDA tensors, and those spans must land in the same record.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

import torch

from . import clock, state
from .intervals import subtract, union
from .spans import COMM_KINDS, COMM_RANGE_PREFIX, COMPUTE, COMPUTE_RANGE_PREFIX, WAIT_RANGE, Span

_autograd_profiler = torch.autograd.profiler


def profiling() -> bool:
    """Whether a torch.profiler is collecting right now (an attribute read; a C call on old torch)."""
    flag = getattr(_autograd_profiler, "_is_profiler_enabled", None)
    return flag if flag is not None else torch._C._autograd._profiler_enabled()


def comm_range(kind: str, name: str = ""):
    """A profiler range to wrap the *issue* of a transfer of `kind`; a no-op when no profiler runs.

    Only the issue goes inside (not the wait): the reader assigns every kernel or copy launched
    inside the range to this transfer, so compute launched later must stay outside it.
    """
    if not profiling():
        return contextlib.nullcontext()
    return torch.profiler.record_function(COMM_RANGE_PREFIX + kind + (f":{name}" if name else ""))


def wait_range():
    """A profiler range `overlapkit.wait` around a host wait for communication; a no-op when no profiler runs.

    A trace reader carves it out of any compute range around it, as the recorder does with
    `Recorder.blocked`: a forward that waits for a gather inside it did not compute meanwhile.
    """
    if not profiling():
        return contextlib.nullcontext()
    return torch.profiler.record_function(WAIT_RANGE)


def _wall_clock_at(t: float) -> float:
    """time.time() in ms at perf_counter() == t, from the best-bracketed of a few paired reads.

    Reading both clocks once could be split by a preemption; the tightest bracket bounds the error.
    """
    best = None
    for _ in range(3):
        a, wall, b = time.perf_counter(), time.time(), time.perf_counter()
        if best is None or b - a < best[0]:
            best = (b - a, wall - ((a + b) / 2 - t))
    return best[1] * 1e3


class PendingSpan:
    """A span whose end is not known yet: stamps (`start`, `end`) in the recorder's clock, resolved to
    milliseconds when the recorder closes. An engine that learns more about a transfer than its issue
    and completion (a pipeline receive whose peer sent late) may move `start` before then."""

    __slots__ = ("kind", "name", "stream", "start", "end", "nbytes", "group_size", "step", "lane")

    def __init__(self, kind, name, stream, start, nbytes, group_size, step):
        self.kind, self.name, self.stream = kind, name, stream
        self.start, self.end = start, None
        self.nbytes, self.group_size, self.step = nbytes, group_size, step
        self.lane = None


class Recorder:
    """Collects spans of one rank. Use through `record()`; read `spans` after it exits."""

    def __init__(self, rank: int | None = None, device: str | torch.device | None = None,
                 poll_s: float = 1e-4) -> None:
        if rank is None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.rank = rank
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.step = 0
        self._pending: list[PendingSpan] = []
        self._blocked: dict[object, list[tuple[object, object]]] = {}
        self._spans: list[Span] | None = None
        self._lock = threading.Lock()
        self._poll_s = poll_s
        self._unwatched: list[tuple[PendingSpan, object]] = []
        self._watch_cv = threading.Condition()
        self._watcher: threading.Thread | None = None
        self._closed = False
        self.host_origin = time.perf_counter()
        """time.perf_counter() at the recorder's 0 ms: host stamps minus this, times 1e3, are span times."""
        # Wall-clock time (ms since the Unix epoch) of the host clock's 0: lines CPU spans up
        # with a profiler trace, whose timestamps are wall-clock microseconds.
        self.origin_unix_ms = _wall_clock_at(self.host_origin)
        self._base_event = None
        if self.cuda:
            self._base_event = torch.cuda.Event(enable_timing=True)
            self._base_event.record()

    # -- clocks ------------------------------------------------------------------------
    def now(self):
        """A time stamp on the current stream (CUDA) or the host clock (CPU)."""
        return clock.stamp(self.cuda)

    def to_ms(self, stamp) -> float:
        """A stamp of `now()` in ms since the recorder started."""
        if isinstance(stamp, float):
            return (stamp - self.host_origin) * 1e3
        return self._base_event.elapsed_time(stamp)

    # -- engine hooks --------------------------------------------------------------------
    def next_step(self) -> None:
        """Spans recorded from now on belong to the next training step."""
        self.step += 1

    @contextlib.contextmanager
    def compute(self, name: str, stream: str = "compute") -> Iterator[None]:
        p = PendingSpan(COMPUTE, name, stream, self.now(), 0, 1, self.step)
        p.lane = self._lane()
        try:
            yield
        finally:
            p.end = self.now()
            with self._lock:
                self._pending.append(p)

    def comm_issued(self, kind: str, name: str, nbytes: int, group_size: int,
                    stream: str = "comm") -> PendingSpan:
        """Stamp the issue of a collective; finish it with `comm_done` or `comm_watch`."""
        if kind not in COMM_KINDS:
            raise ValueError(f"unknown communication kind {kind!r}; expected one of {COMM_KINDS}")
        p = PendingSpan(kind, name, stream, self.now(), nbytes, group_size, self.step)
        with self._lock:
            self._pending.append(p)
        return p

    def record_span(self, kind: str, name: str, stream: str, start, end, step: int | None = None) -> None:
        """Add a finished span from two stamps of this recorder's clock (a pipeline bubble, which is
        neither a computation nor a transfer); it is resolved like every other span at close."""
        p = PendingSpan(kind, name, stream, start, 0, 1, self.step if step is None else step)
        p.end = end
        with self._lock:
            self._pending.append(p)

    def _lane(self):
        """What a wait stalls: the current CUDA stream, or (on CPU) the host."""
        return torch.cuda.current_stream(self.device).cuda_stream if self.cuda else None

    def blocked(self, t0, t1) -> None:
        """The caller waited for communication from stamp t0 to t1 (host clock, or CUDA events
        on the waiting stream): that stretch is not compute for spans of the same lane, even
        a compute span that encloses it. A side stream's wait takes nothing from compute."""
        self._blocked.setdefault(self._lane(), []).append((t0, t1))

    def comm_done(self, p: PendingSpan, stamp=None) -> None:
        if p.end is None:
            p.end = stamp if stamp is not None else self.now()

    def comm_watch(self, p: PendingSpan, work) -> None:
        """Stamp the completion of a CPU `Work` when it happens, not when somebody waits."""
        try:
            work.get_future().then(lambda _f: self.comm_done(p, time.perf_counter()))
            return
        except RuntimeError:
            pass  # gloo send/recv and reduce_scatter have no future: poll them instead
        with self._watch_cv:
            self._unwatched.append((p, work))
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch, daemon=True, name="overlapkit-watch")
                self._watcher.start()
            self._watch_cv.notify()

    def _watch(self) -> None:
        while True:
            with self._watch_cv:
                while not self._unwatched and not self._closed:
                    self._watch_cv.wait()
                if self._closed and not self._unwatched:
                    return
                items = list(self._unwatched)
            done = []
            for p, work in items:
                if p.end is not None or work.is_completed():
                    self.comm_done(p, time.perf_counter())
                    done.append((p, work))
            if done:
                with self._watch_cv:
                    self._unwatched = [x for x in self._unwatched if x not in done]
            time.sleep(self._poll_s)

    # -- results -------------------------------------------------------------------------
    def close(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        with self._watch_cv:
            self._closed = True
            self._watch_cv.notify()
        if self._watcher is not None:
            self._watcher.join(timeout=5.0)
        blocked = {lane: union((self.to_ms(a), self.to_ms(b)) for a, b in pairs)
                   for lane, pairs in self._blocked.items()}
        spans = []
        for p in self._pending:
            if p.end is None:
                continue  # a collective nobody waited for: no honest end time exists
            start, end = self.to_ms(p.start), self.to_ms(p.end)
            pieces = [(start, max(start, end))]
            if p.kind == COMPUTE and blocked.get(p.lane):
                # A compute span that encloses communication (a whole forward, say) computed
                # only while its thread was not blocked in a wait.
                pieces = subtract(pieces, blocked[p.lane])
            spans += [Span(kind=p.kind, name=p.name, stream=p.stream, start_ms=a, end_ms=b, rank=self.rank,
                           nbytes=p.nbytes, group_size=p.group_size, step=p.step) for a, b in pieces]
        spans.sort(key=lambda s: (s.start_ms, s.end_ms))
        self._spans = spans

    @property
    def spans(self) -> list[Span]:
        """All finished spans, sorted by start. Available after `record()` exits."""
        if self._spans is None:
            raise RuntimeError("spans are resolved when record() exits (CUDA events need a synchronize)")
        return self._spans


_ACTIVE = state.process_dict("recorder.active")
"""The recorder in force under key None: set and cleared by `record()` (process-wide, see the module doc)."""


def active() -> Recorder | None:
    """The recorder in force, or None (the engines' fast path)."""
    return _ACTIVE.get(None)


@contextlib.contextmanager
def record(rank: int | None = None, device: str | torch.device | None = None, *,
           recorder: type[Recorder] = Recorder) -> Iterator[Recorder]:
    """Record every engine's spans on this rank while the block runs.

    `device` picks the clock: a CUDA device records CUDA events, anything else the host clock.
    `recorder` is the class made (the timeline's `record()` passes one that can report and draw itself).
    """
    if _ACTIVE.get(None) is not None:
        raise RuntimeError("a timeline recorder is already active in this process")
    rec = recorder(rank=rank, device=device)
    _ACTIVE[None] = rec
    try:
        yield rec
    finally:
        _ACTIVE.pop(None, None)
        rec.close()


@contextlib.contextmanager
def compute_span(name: str, stream: str = "compute") -> Iterator[None]:
    """Mark a computation (a GEMM) for the active recorder and any running profiler; free when neither is."""
    rec, traced = _ACTIVE.get(None), profiling()
    if rec is None and not traced:
        yield
        return
    # The recorder's stamps enclose the profiler range: a reader span never outgrows its record.
    with rec.compute(name, stream) if rec is not None else contextlib.nullcontext():
        with torch.profiler.record_function(COMPUTE_RANGE_PREFIX + name) if traced else contextlib.nullcontext():
            yield
