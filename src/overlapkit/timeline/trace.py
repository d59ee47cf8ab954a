"""Read a PyTorch profiler (Kineto) Chrome trace into the spans the report measures overlap on.

A GPU trace gives one span per kernel, memcpy and memset, on its CUDA stream. A kernel is
communication when `timeline/kinds.py` says so (NCCL/RCCL, DeepEP, userbuffers, symmetric
memory, NVSHMEM; a peer-to-peer copy) or when it was launched inside an overlapkit
`overlapkit.comm.<kind>` range. Collective name, message size, group size and process group
come from the kernel's args or the matching `record_param_comms` op; the step from the
`ProfilerStep#N` range its launch fell in (a kernel with no launch in the trace has no step);
the phase (forward/backward/optimizer/pipeline) from `timeline/phases.py`. A collective torch's
FSDP2 issued inside its `FSDP::all_gather` / `FSDP::post_backward_reduce` range is
`zero_all_gather` / `zero_reduce_scatter`, named by module (`timeline/fsdp2.py`).

An event whose times the reader uses must carry them as real numbers within a day of the others, and the
trace's rank must lie in its world: anything else is refused in one line naming the event and the field
(`timeline/validate.py`), never read as 0. A CPU-only trace (gloo) is read by `timeline/cpu_trace.py`.
Traces of other devices (MTIA) are refused, not misread as CPU traces. The last `ProfilerStep` is dropped
when a trace holds two or more (a profiler usually stops inside it), as HolisticTraceAnalysis does;
`last_step=True` keeps it.
"""

from __future__ import annotations

import bisect
import gc
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from . import cpu_trace, validate
from .framework import GRAPH_LAUNCHES, HOST_SYNCS, KERNEL_LAUNCH, launch_waits, tag
from .fsdp2 import is_fsdp_range
from .gpu_trace import gpu_spans, keep_gpu
from .jsonstream import UNSUPPORTED_DEVICES, TraceEvents, TraceFileError, unsupported
from .kinds import collective_kind
from .messages import dtype_bytes, keep
from .phases import marker_phase, span_phase
from .ranges import Ranges
from .serving import outermost_steps, step_kind
from .validate import BadTrace
from ..runtime.spans import COMM_RANGE_PREFIX, COMPUTE_RANGE_PREFIX, WAIT_RANGE, Span

__all__ = ["Trace", "TraceError", "collective_kind", "dtype_bytes", "read_trace", "read_traces", "trace_files"]

GPU_CATEGORIES = {"kernel": "kernel", "gpu_memcpy": "memcpy", "memcpy": "memcpy",
                  "gpu_memset": "memset", "memset": "memset"}
LAUNCH_CATEGORIES = {"cuda_runtime", "cuda_driver", "runtime", "driver"}
CPU_OP_CATEGORIES = {"cpu_op", "operator"}
MARKER_CATEGORIES = CPU_OP_CATEGORIES | {"user_annotation", "python_function"}
"""Categories of the CPU ranges that can mark a phase (timeline/phases.py)."""
TAGGED_CATEGORIES = MARKER_CATEGORIES | LAUNCH_CATEGORIES
"""Categories whose names are evidence of the job's framework (timeline/framework.py)."""
_STEP_PREFIX = "ProfilerStep#"
JOB_ID_KEYS = ("group_trace_id", "mast_job_name", "tw_job", "job_id")
"""Trace metadata naming the job, when the profiler wrote one (first found wins)."""
TRACE_SUFFIXES, _INF = (".json", ".json.gz"), math.inf


class TraceError(ValueError):
    """A file that cannot be analyzed; the message names the file and the problem, in one line."""


@dataclass
class Trace:
    """What one rank's trace holds, in the report's terms."""

    path: str
    """The file it was read from."""
    rank: int
    """Global rank, from `distributedInfo` (or given)."""
    world_size: int | None
    """World size from `distributedInfo`, when present."""
    spans: list[Span]
    """Spans in ms from `origin_unix_ms`, sorted by start."""
    origin_unix_ms: float
    """Wall-clock time (ms since the Unix epoch) of the spans' 0."""
    steps: list[int]
    """ProfilerStep numbers whose spans are kept."""
    dropped_step: int | None
    """The last ProfilerStep, dropped; None when nothing was dropped."""
    device: str
    """'gpu' (kernels and copies) or 'cpu' (gloo ranges, overlapkit ranges, CPU ops)."""
    compute_known: bool = True
    """False when the trace records no computation to compare with (a CPU trace without ops)."""
    notes: list[str] = field(default_factory=list)
    """What the reader had to assume or could not see, one line each."""
    gpu_name: str | None = None
    """The device's name from `deviceProperties` (for the hardware's link peak)."""
    job_id: str | None = None
    """The job's id from the trace metadata (see JOB_ID_KEYS), when present."""
    issue: list = field(default_factory=list)
    """Per span (as `spans`): (thread, issue ms, launch name) of its launch or issue, or None (CPU compute, no launch)."""
    host_syncs: list = field(default_factory=list)
    """(thread, start ms, end ms) of every host call that waited for the GPU (cudaStreamSynchronize, ...)."""
    launch_waits: list = field(default_factory=list)
    """(thread, start ms, end ms) of kernel launches' waits for room in the GPU's queue (framework.launch_waits)."""
    host_ops: list = field(default_factory=list)
    """(thread, start ms, end ms, name) of the outermost CPU ops of each thread: what the host ran."""
    blocked: list = field(default_factory=list)
    """(thread, start ms, end ms) a CPU trace's compute threads sat blocked in a wait for communication."""
    step_ranges: dict = field(default_factory=dict)
    """ProfilerStep number -> (start ms, end ms) of its CPU range."""
    serving_ranges: list = field(default_factory=list)
    """(kind, start ms, end ms) of every serving step's range, prefill or decode (timeline/serving.py's rule)."""
    phase_ranges: list = field(default_factory=list)
    """(thread, start ms, end ms, phase) of the CPU ranges that mark a phase (timeline/phases.py): the optimizer's."""
    evidence: dict = field(default_factory=dict)
    """Framework evidence: tag -> how many events carried it (timeline/framework.py)."""

    def shift(self, offset_ms: float) -> None:
        """Move every time of the trace `offset_ms` earlier (a new origin, or a clock correction)."""
        if not offset_ms:
            return
        self.spans = [s.shifted(offset_ms) for s in self.spans]
        self.issue = [None if i is None else (i[0], i[1] - offset_ms, *i[2:]) for i in self.issue]
        self.host_syncs, self.launch_waits, self.blocked, self.host_ops, self.phase_ranges = (
            [(t, a - offset_ms, b - offset_ms, *n) for t, a, b, *n in v]
            for v in (self.host_syncs, self.launch_waits, self.blocked, self.host_ops, self.phase_ranges))
        self.step_ranges = {n: (a - offset_ms, b - offset_ms) for n, (a, b) in self.step_ranges.items()}
        self.serving_ranges = [(k, a - offset_ms, b - offset_ms) for k, a, b in self.serving_ranges]


def _role(cat: str, name: str) -> tuple:
    """(lower-case category, what the reader does with an X event of it and this name, its framework tag, the
    phase it marks, the serving step it is: prefill, decode or None). The role is None for events whose times no
    number is read from (Python frames, GPU images of CPU ranges, ranges that mark nothing): those are neither kept
    nor checked (validate.py).
    Refuses a category of a device overlapkit cannot read."""
    if (device := cat.split("_", 1)[0]) in UNSUPPORTED_DEVICES:
        raise unsupported(device)
    marker = marker_phase(name) if cat in MARKER_CATEGORIES else None
    t = tag(name) if cat in TAGGED_CATEGORIES else None
    serve = step_kind(name) if cat in MARKER_CATEGORIES else None
    if cat in GPU_CATEGORIES:
        role = "gpu"
    elif cat in LAUNCH_CATEGORIES:
        role = "launch"
    elif cat.startswith("gpu_"):
        return cat, None, t, None, None  # gpu_user_annotation: GPU images of CPU ranges, not work of their own
    elif name.startswith(_STEP_PREFIX) and name[len(_STEP_PREFIX):].isdigit():
        role = "step"
    elif name.startswith((COMM_RANGE_PREFIX, COMPUTE_RANGE_PREFIX)) or name == WAIT_RANGE:
        role = "range"
    elif is_fsdp_range(name):
        role = "fsdp"
    elif name == "record_param_comms":
        role = "param"
    elif name.startswith("gloo:"):
        role = "gloo"
    elif cat in CPU_OP_CATEGORIES:
        role = "op"
    else:
        role = "marker" if marker is not None or serve is not None else None
    return cat, role, t, marker, serve


def _gpu_name(meta: dict) -> str | None:
    props = meta.get("deviceProperties")
    if isinstance(props, list) and props and isinstance(props[0], dict):
        return str(props[0].get("name", "")) or None
    return None


def _outermost(ops) -> list:
    """The ops no other op of the same thread encloses, per thread, in time order."""
    out, last_end = [], {}
    for tid, a, b, name in sorted(ops, key=lambda o: (str(o[0]), o[1], -o[2])):
        if a >= last_end.get(tid, -_INF):
            out.append((tid, a, b, name))
            last_end[tid] = b
    return out


def read_trace(path: str | Path, rank: int | None = None, last_step: bool = False, stream: bool | None = None,
               on_bytes=None) -> Trace:
    """Read one rank's profiler trace (`.json` or `.json.gz`). Raises TraceError on bad input.

    `rank` overrides (or supplies) the rank of `distributedInfo`; `last_step` keeps the last
    ProfilerStep of a trace with several (dropped by default, see the module docstring).
    `stream` forces (True) or forbids (False) the streamed, bounded-memory parse (default: by
    size, timeline/jsonstream.py); `on_bytes(n)` is told how many bytes of the file were read.
    """
    path = Path(path)
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise TraceError(f"rank {rank!r}: a rank is an integer >= 0")
    try:
        source = TraceEvents(path, stream=stream, on_bytes=on_bytes)
    except TraceFileError as e:
        raise TraceError(f"{path}: {e}") from None
    gpu, launches, steps, syncs, kernel_launches, evidence = [], {}, [], [], [], {}
    ranges, param_comms, param_by_ext, markers, fsdp = Ranges(), Ranges(), {}, Ranges(), Ranges()
    gloo, ops, serving = [], [], []
    first, last, starts = (_INF, -1, None), (-_INF, -1, None), []  # the used events' earliest start, latest end
    roles = {}  # (cat, name) -> _role(...): names repeat 10^5 times, so each is classified once
    try:
        for i, e in enumerate(source):
            if type(e) is not dict:
                raise validate.not_an_event(i, e)
            if e.get("ph") != "X":
                continue
            cat, name = e.get("cat", ""), e.get("name", "")
            if type(cat) is not str or type(name) is not str:
                cat, name = str(cat), str(name)
            if (known := roles.get((cat, name))) is None:
                known = roles[(cat, name)] = (*_role(cat.lower(), name), name)
            cat, role, t, phase, serve, name = known  # the first event's name: one str kept per distinct name
            if t is not None:
                evidence[t] = evidence.get(t, 0) + 1
            if role is None:
                continue  # a Python frame, a range that marks nothing: no time of it is read
            ts, dur = e.get("ts"), e.get("dur")
            if type(ts) not in (int, float) or type(dur) not in (int, float):  # the rare case, checked in full
                ts, dur = validate.number(i, e, "ts"), validate.number(i, e, "dur")
            if not (-_INF < ts < _INF and 0 <= dur <= validate.DAY_US):
                validate.check_time(i, e, ts, dur)
            tid = e.get("tid")
            if role == "gpu":
                gpu.append((GPU_CATEGORIES[cat], name, ts, ts + dur, keep_gpu(e.get("args") or {})))
            elif role == "op":
                ops.append((tid, ts, ts + dur, name))
            elif role == "launch":
                args = e.get("args") or {}
                if "correlation" in args:
                    launches[args["correlation"]] = (tid, ts, name)
                if name in HOST_SYNCS:
                    syncs.append((tid, ts, ts + dur))
                elif KERNEL_LAUNCH in name:
                    kernel_launches.append((tid, ts, ts + dur))
            elif role == "step":
                steps.append((ts, ts + dur, int(name[len(_STEP_PREFIX):])))
            elif role == "range":
                ranges.add(tid, ts, ts + dur, {"name": name, "ts": ts})
            elif role == "fsdp":
                fsdp.add(tid, ts, ts + dur, {"name": name})
            elif role == "param":
                args = e.get("args") or {}
                param_comms.add(tid, ts, ts + dur, keep(args))
                if "External id" in args:
                    param_by_ext[args["External id"]] = keep(args)
            elif role == "gloo":
                gloo.append((tid, ts, ts + dur, name, keep(e.get("args") or {})))
            if phase is not None:
                markers.add(tid, ts, ts + dur, {"phase": phase})
            if serve is not None:
                serving.append((tid, ts, ts + dur, serve))
            starts.append(ts)
            if ts < first[0]:
                first = (ts, i, e)
            if ts + dur > last[0]:
                last = (ts + dur, i, e)
        validate.check_span(first, last, starts)
        del starts
    except (TraceFileError, BadTrace) as e:
        raise TraceError(f"{path}: {e}") from None
    meta = source.meta
    base_us = float(meta.get("baseTimeNanoseconds", 0) or 0) / 1e3
    for r in (ranges, param_comms, markers, fsdp):
        r.freeze()
    steps.sort()

    info = meta.get("distributedInfo") if isinstance(meta.get("distributedInfo"), dict) else {}
    compute_known, notes, blocked = True, [], []
    if gpu:
        raw = gpu_spans(gpu, launches, ranges, param_comms, param_by_ext, markers, fsdp)
        device = "gpu"
    elif launches:
        raise TraceError(f"{path}: {len(launches)} CUDA launches but no kernel, memcpy or memset events: "
                         f"profile with ProfilerActivity.CUDA to see the GPU")
    else:
        raw, compute_known, notes, blocked = cpu_trace.cpu_spans(ranges, gloo, ops, markers, info, fsdp)
        device = "cpu"
    del gpu, launches, gloo
    if not raw:
        raise TraceError(f"{path}: no GPU kernels, memcpy or memset, and no CPU ops, overlapkit or gloo "
                         f"ranges: nothing to analyze")

    if rank is None:
        if not isinstance(info.get("rank"), int) or info["rank"] < 0:
            raise TraceError(f"{path}: no rank: the trace has no distributedInfo.rank "
                             f"(profile with torch.distributed initialized, or give the rank)")
        rank = info["rank"]
    if (problem := validate.check_rank(rank, info.get("world_size"))) is not None:
        raise TraceError(f"{path}: {problem}")

    step_starts = [s[0] for s in steps]
    dropped = None
    if len(steps) >= 2 and not last_step:
        dropped = steps[-1][2]
        raw = [r for r in raw if r[0] < steps[-1][0]]
        if not raw:
            raise TraceError(f"{path}: all work was issued in the last ProfilerStep (#{dropped}), which is left out "
                             f"(a profiler usually stops inside it): give --last-step to keep it")

    def step_of(t: float | None) -> int | None:
        if t is None:
            return None
        i = bisect.bisect_right(step_starts, t) - 1
        return steps[i][2] if i >= 0 and t <= steps[i][1] else None

    origin = min(r[1].start_ms for r in raw)
    ms = lambda t: (t - origin) / 1e3  # noqa: E731
    placed = []
    for issued, s, launched, issuer in raw:
        step = step_of(issued if launched else None)
        phase = span_phase(s.kind, s.phase, step is not None) if s.is_comm or s.phase else None
        how = None if issuer is None else (issuer[0], ms(issuer[1]), issuer[2] if len(issuer) > 2 else "")
        placed.append((_place(s, origin, rank, step, phase), how))
    placed.sort(key=lambda p: (p[0].start_ms, p[0].end_ms))
    stepless = sum(1 for _, _, launched, _ in raw if not launched)
    if stepless:
        notes.append(f"{stepless} GPU events have no launch in the trace: counted, in no step")
    graphs = sum(1 for _, how in placed if how is not None and how[2] in GRAPH_LAUNCHES)
    if graphs:
        notes.append(f"{graphs} kernels replayed by CUDA graphs: tied to their graph's launch")
    spans = [p[0] for p in placed]
    kept = sorted({s.step for s in spans if s.step is not None})
    world = info.get("world_size")
    job = next((str(meta[k]) for k in JOB_ID_KEYS if meta.get(k)), None)
    return Trace(path=str(path), rank=rank, world_size=world if isinstance(world, int) else None, spans=spans,
                 origin_unix_ms=(base_us + origin) / 1e3, steps=kept, dropped_step=dropped, device=device,
                 compute_known=compute_known, notes=notes, gpu_name=_gpu_name(meta), job_id=job,
                 issue=[p[1] for p in placed], host_syncs=[(t, ms(a), ms(b)) for t, a, b in syncs],
                 launch_waits=[(t, ms(a), ms(b)) for t, a, b in launch_waits(kernel_launches)],
                 host_ops=[(t, ms(a), ms(b), n) for t, a, b, n in _outermost(ops)],
                 blocked=[(t, ms(a), ms(b)) for t, a, b in blocked], phase_ranges=[
                     (t, ms(a), ms(b), x["phase"]) for t, a, b, x in markers.rows()],
                 step_ranges={n: (ms(a), ms(b)) for a, b, n in steps if n in kept or n == dropped},
                 serving_ranges=[(k, ms(a), ms(b)) for a, b, k in outermost_steps(serving)
                                 if dropped is None or a < steps[-1][0]], evidence=evidence)


def _place(s: Span, origin_us: float, rank: int, step: int | None, phase: str | None) -> Span:
    """A span held in raw trace microseconds, moved to ms from the origin."""
    return Span(kind=s.kind, name=s.name, stream=s.stream, start_ms=(s.start_ms - origin_us) / 1e3,
                end_ms=(s.end_ms - origin_us) / 1e3, rank=rank, nbytes=s.nbytes,
                group_size=s.group_size, step=step, phase=phase, group=s.group)


def _without_gc(fn, *args, **kwargs):
    """Call fn with the cyclic garbage collector paused: a trace's 10^5 event dicts hold no cycles,
    and collections triggered while parsing them cost up to half the read time (more beside a
    large live heap)."""
    was = gc.isenabled()
    gc.disable()
    try:
        return fn(*args, **kwargs)
    finally:
        if was:
            gc.enable()


def trace_files(paths) -> list[Path]:
    """Every trace named: a file as given, a directory as its `*.json` / `*.json.gz` files (sorted).

    A directory is what `torch.profiler.tensorboard_trace_handler` writes (and HTA reads).
    """
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(q for q in p.iterdir() if q.is_file() and q.name.endswith(TRACE_SUFFIXES))
            if not found:
                raise TraceError(f"{p}: a directory with no .json or .json.gz trace in it")
            out += found
        else:
            out.append(p)
    return out


def read_traces(paths, rank: int | None = None, last_step: bool = False, stream: bool | None = None,
                progress=None) -> list[Trace]:
    """Read several ranks' traces (files or directories) onto one time axis when they overlap in time.

    Traces of one job share the wall clock, so their spans line up; traces that never overlap
    in time (different jobs) would be years apart on one axis, so each keeps its own origin.
    `progress`: an object with `feed(path) -> on_bytes` (timeline/progress.py's bar).
    """
    files = trace_files(paths)
    if rank is not None and len(files) != 1:
        raise TraceError(f"a rank can be given for one trace only, not {len(files)}")
    traces = []
    for p in files:
        traces.append(_without_gc(read_trace, p, rank=rank, last_step=last_step, stream=stream,
                                  on_bytes=None if progress is None else progress.feed(p)))
    starts = [t.origin_unix_ms for t in traces]
    ends = [t.origin_unix_ms + max(s.end_ms for s in t.spans) for t in traces]
    if len(traces) > 1 and max(starts) < min(ends):
        origin = min(starts)
        for t in traces:
            t.shift(origin - t.origin_unix_ms)
            t.origin_unix_ms = origin
    return traces


def label(path: str) -> str:
    """A short name of a trace file: its name without the .json/.json.gz suffix."""
    name = os.path.basename(path)
    for suffix in TRACE_SUFFIXES[::-1]:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name
