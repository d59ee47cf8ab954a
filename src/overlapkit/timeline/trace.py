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

A CPU-only trace (gloo) is read by `timeline/cpu_trace.py`. Traces of other devices (MTIA)
are refused as unsupported rather than misread as CPU traces.

The last `ProfilerStep` is dropped when a trace holds two or more (a profiler usually stops
inside it), as HolisticTraceAnalysis does; `last_step=True` keeps it.
"""

from __future__ import annotations

import bisect
import gc
import gzip
import json
import os
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from . import cpu_trace
from .fsdp2 import fsdp2_comm, is_fsdp_range
from .kinds import collective_kind, copy_comm_kind, is_nccl, kernel_comm_kind, nccl_kind_from_name
from .phases import marker_phase, span_phase
from .ranges import Ranges
from .spans import COMM_RANGE_PREFIX, COMPUTE, COMPUTE_RANGE_PREFIX, WAIT_RANGE, Span

__all__ = ["Trace", "TraceError", "collective_kind", "read_trace", "read_traces", "trace_files"]

GPU_CATEGORIES = {"kernel": "kernel", "gpu_memcpy": "memcpy", "memcpy": "memcpy",
                  "gpu_memset": "memset", "memset": "memset"}
LAUNCH_CATEGORIES = {"cuda_runtime", "cuda_driver", "runtime", "driver"}
CPU_OP_CATEGORIES = {"cpu_op", "operator"}
MARKER_CATEGORIES = CPU_OP_CATEGORIES | {"user_annotation", "python_function"}
"""Categories of the CPU ranges that can mark a phase (timeline/phases.py)."""
UNSUPPORTED_DEVICES = {"mtia": "MTIA", "xpu": "XPU", "hpu": "HPU"}
"""Category prefixes of device activity overlapkit cannot read (its kernels are not CUDA/ROCm kernels)."""
_DEVICE_CAT = re.compile(rb'"cat"\s*:\s*"(mtia|xpu|hpu)_', re.IGNORECASE)
_DTYPE_BYTES = {"float": 4, "float32": 4, "half": 2, "float16": 2, "bfloat16": 2, "c10::bfloat16": 2,
                "c10::half": 2, "double": 8, "float64": 8, "int": 4, "int32": 4, "long": 8, "int64": 8,
                "short": 2, "int16": 2, "char": 1, "byte": 1, "int8": 1, "uint8": 1, "bool": 1}
_STEP = re.compile(r"^ProfilerStep#(\d+)$")
JOB_ID_KEYS = ("group_trace_id", "mast_job_name", "tw_job", "job_id")
"""Trace metadata naming the job, when the profiler wrote one (first found wins)."""
TRACE_SUFFIXES = (".json", ".json.gz")


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


def _load(path: Path) -> object:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise TraceError(f"{path}: cannot read: {e.strerror or e}") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise TraceError(f"{path}: truncated or corrupt gzip ({e})") from None
    # Refuse other devices' traces before parsing them (MTIA traces run to tens of MB of JSON).
    if (m := _DEVICE_CAT.search(raw)) is not None:
        raise TraceError(f"{path}: unsupported device: {UNSUPPORTED_DEVICES[m.group(1).decode().lower()]} "
                         f"(overlapkit reads CUDA/ROCm kernel traces and CPU gloo traces)")
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceError(f"{path}: not a trace: not JSON ({e})") from None


def _number(path: Path, i: int, e: dict, key: str) -> float:
    value = e.get(key, 0) or 0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            return float(value)
        except (TypeError, ValueError):
            raise TraceError(f"{path}: event {i} ({str(e.get('name', '?'))[:60]!r}) has a non-numeric "
                             f"{key}: {str(value)[:40]!r}") from None
    return float(value)


def dtype_bytes(dtype: object) -> int:
    """Bytes per element of a trace's dtype name (`Float`, `BFloat16`, `c10::Half`); 0 when unknown."""
    return _DTYPE_BYTES.get(str(dtype).lower(), 0)


def _message(meta: dict) -> tuple[int, int]:
    """(message bytes, group size) from collective metadata; 0 where unknown."""
    elems = max(int(meta.get("In msg nelems", 0) or 0), int(meta.get("Out msg nelems", 0) or 0))
    return elems * dtype_bytes(meta.get("dtype", "")), int(meta.get("Group size", 0) or 0)


def _unsupported(path: Path, categories: set[str], meta: dict) -> None:
    for prefix, device in UNSUPPORTED_DEVICES.items():
        if any(c.startswith(prefix) for c in categories):
            raise TraceError(f"{path}: unsupported device: {device} (overlapkit reads CUDA/ROCm kernel "
                             f"traces and CPU gloo traces)")


def _gpu_name(meta: dict) -> str | None:
    props = meta.get("deviceProperties")
    if isinstance(props, list) and props and isinstance(props[0], dict):
        return str(props[0].get("name", "")) or None
    return None


def read_trace(path: str | Path, rank: int | None = None, last_step: bool = False) -> Trace:
    """Read one rank's profiler trace (`.json` or `.json.gz`). Raises TraceError on bad input.

    `rank` overrides (or supplies) the rank of `distributedInfo`; `last_step` keeps the last
    ProfilerStep of a trace with several (dropped by default, see the module docstring).
    """
    path = Path(path)
    doc = _load(path)
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events[:100]):
        raise TraceError(f"{path}: not a trace: no traceEvents list of events")
    meta = doc if isinstance(doc, dict) else {}
    base_us = float(meta.get("baseTimeNanoseconds", 0) or 0) / 1e3

    gpu, launches, steps, categories = [], {}, [], set()
    ranges, param_comms, param_by_ext, markers, fsdp = Ranges(), Ranges(), {}, Ranges(), Ranges()
    gloo, ops = [], []
    for i, e in enumerate(events):
        if not isinstance(e, dict) or e.get("ph") != "X" or "ts" not in e:
            continue
        cat, name, args = str(e.get("cat", "")).lower(), str(e.get("name", "")), e.get("args") or {}
        ts, dur = e["ts"], e.get("dur", 0)
        if type(ts) not in (int, float) or type(dur) not in (int, float):  # the rare case, checked in full
            ts, dur = _number(path, i, e, "ts"), _number(path, i, e, "dur")
        categories.add(cat)
        tid = e.get("tid")
        if cat in GPU_CATEGORIES:
            gpu.append((GPU_CATEGORIES[cat], name, ts, ts + dur, args))
        elif cat in LAUNCH_CATEGORIES and "correlation" in args:
            launches[args["correlation"]] = (tid, ts)
        elif cat.startswith("gpu_"):
            continue  # gpu_user_annotation: GPU images of CPU ranges, not work of their own
        elif (m := _STEP.match(name)) is not None:
            steps.append((ts, ts + dur, int(m.group(1))))
        elif name.startswith((COMM_RANGE_PREFIX, COMPUTE_RANGE_PREFIX)) or name == WAIT_RANGE:
            ranges.add(tid, ts, ts + dur, {"name": name, "ts": ts})
        elif is_fsdp_range(name):
            fsdp.add(tid, ts, ts + dur, {"name": name})
        elif name == "record_param_comms":
            param_comms.add(tid, ts, ts + dur, args)
            if "External id" in args:
                param_by_ext[args["External id"]] = args
        elif name.startswith("gloo:"):
            gloo.append((tid, ts, ts + dur, name, args))
        elif cat in CPU_OP_CATEGORIES:
            ops.append((tid, ts, ts + dur, name))
        if cat in MARKER_CATEGORIES and (phase := marker_phase(name)) is not None:
            markers.add(tid, ts, ts + dur, {"phase": phase})
    _unsupported(path, categories, meta)
    for r in (ranges, param_comms, markers, fsdp):
        r.freeze()
    steps.sort()

    info = meta.get("distributedInfo") if isinstance(meta.get("distributedInfo"), dict) else {}
    compute_known, notes = True, []
    if gpu:
        raw = _gpu_spans(gpu, launches, ranges, param_comms, param_by_ext, markers, fsdp)
        device = "gpu"
    elif launches:
        raise TraceError(f"{path}: {len(launches)} CUDA launches but no kernel, memcpy or memset events: "
                         f"profile with ProfilerActivity.CUDA to see the GPU")
    else:
        raw, compute_known, notes = cpu_trace.cpu_spans(ranges, gloo, ops, markers, info, fsdp)
        device = "cpu"
    if not raw:
        raise TraceError(f"{path}: no GPU kernels, memcpy or memset, and no CPU ops, overlapkit or gloo "
                         f"ranges: nothing to analyze")

    if rank is None:
        if not isinstance(info.get("rank"), int):
            raise TraceError(f"{path}: no rank: the trace has no distributedInfo.rank "
                             f"(profile with torch.distributed initialized, or give the rank)")
        rank = info["rank"]

    step_starts = [s[0] for s in steps]
    dropped = None
    if len(steps) >= 2 and not last_step:
        dropped = steps[-1][2]
        raw = [r for r in raw if r[0] < steps[-1][0]]

    def step_of(t: float | None) -> int | None:
        if t is None:
            return None
        i = bisect.bisect_right(step_starts, t) - 1
        return steps[i][2] if i >= 0 and t <= steps[i][1] else None

    origin = min(r[1].start_ms for r in raw)
    spans = []
    for issued, s, launched in raw:
        step = step_of(issued if launched else None)
        phase = span_phase(s.kind, s.phase, step is not None) if s.is_comm or s.phase else None
        spans.append(_place(s, origin, rank, step, phase))
    spans.sort(key=lambda s: (s.start_ms, s.end_ms))
    stepless = sum(1 for _, _, launched in raw if not launched)
    if stepless:
        notes.append(f"{stepless} GPU events have no launch in the trace: counted, in no step")
    kept = sorted({s.step for s in spans if s.step is not None})
    world = info.get("world_size")
    job = next((str(meta[k]) for k in JOB_ID_KEYS if meta.get(k)), None)
    return Trace(path=str(path), rank=rank, world_size=world if isinstance(world, int) else None, spans=spans,
                 origin_unix_ms=(base_us + origin) / 1e3, steps=kept, dropped_step=dropped, device=device,
                 compute_known=compute_known, notes=notes, gpu_name=_gpu_name(meta), job_id=job)


def _place(s: Span, origin_us: float, rank: int, step: int | None, phase: str | None) -> Span:
    """A span held in raw trace microseconds, moved to ms from the origin."""
    return Span(kind=s.kind, name=s.name, stream=s.stream, start_ms=(s.start_ms - origin_us) / 1e3,
                end_ms=(s.end_ms - origin_us) / 1e3, rank=rank, nbytes=s.nbytes,
                group_size=s.group_size, step=step, phase=phase, group=s.group)


def range_label(name: str) -> tuple[str, str]:
    """('comm', kind), ('compute', name) or ('wait', '') for an overlapkit range name."""
    if name == WAIT_RANGE:
        return "wait", ""
    if name.startswith(COMM_RANGE_PREFIX):
        return "comm", name[len(COMM_RANGE_PREFIX):].split(":", 1)[0]
    return "compute", name[len(COMPUTE_RANGE_PREFIX):]


def _gpu_spans(gpu, launches, ranges, param_comms, param_by_ext, markers, fsdp) -> list[tuple[float, Span, bool]]:
    """(launch time, span in raw µs, has a launch) for every kernel, memcpy and memset."""
    devices = {a.get("device") for _, _, _, _, a in gpu}
    out = []
    for what, name, start, end, args in gpu:
        launch = launches.get(args.get("correlation"))
        issued = launch[1] if launch else start
        stream = f"stream {args.get('stream', '?')}"
        if len(devices) > 1:
            stream = f"gpu {args.get('device')} {stream}"
        rng = ranges.find(launch[0], launch[1]) if launch else None
        label = range_label(rng["name"]) if rng else (None, None)
        kind, span_name, nbytes, group, pg = COMPUTE, name, 0, 0, ""
        if what != "kernel":
            kind, nbytes = copy_comm_kind(name) or what, int(args.get("bytes", 0) or 0)
        elif is_nccl(name):
            kind, nbytes, group, pg = _nccl_kind(name, args, launch, param_comms, param_by_ext)
        elif (other := kernel_comm_kind(name)) is not None:
            kind = other
        elif label[0] == "compute":
            span_name = label[1]
        if kind != COMPUTE and launch and (chain := fsdp.enclosing(*launch)):
            # FSDP2's collective (not its copy-in/out kernels): its ZeRO-3 kind, named by module.
            got = fsdp2_comm([r["name"] for r in chain], kind.removeprefix("zero_"))
            if got is not None:
                kind, span_name = got
        if label[0] == "comm":
            kind = label[1]  # our own range names the transfer, whatever ran it
        marked = markers.find(*launch) if launch else None
        out.append((issued, Span(kind=kind, name=span_name, stream=stream, start_ms=start, end_ms=end,
                                 nbytes=nbytes, group_size=group, group=pg,
                                 phase=marked["phase"] if marked else None), launch is not None))
    return out


def _nccl_kind(name, args, launch, param_comms, param_by_ext) -> tuple[str, int, int, str]:
    """(collective, message bytes, group size, process group ranks) of an NCCL kernel."""
    meta = args if "Collective name" in args else param_by_ext.get(args.get("External id"))
    if (meta is None or "Collective name" not in meta) and launch:
        meta = param_comms.find(*launch)
    if meta is not None and "Collective name" in meta:
        nbytes, group = _message(meta)
        return collective_kind(str(meta["Collective name"])), nbytes, group, str(meta.get("Process Group Ranks", ""))
    return nccl_kind_from_name(name), 0, 0, ""


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


def read_traces(paths, rank: int | None = None, last_step: bool = False) -> list[Trace]:
    """Read several ranks' traces (files or directories) onto one time axis when they overlap in time.

    Traces of one job share the wall clock, so their spans line up; traces that never overlap
    in time (different jobs) would be years apart on one axis, so each keeps its own origin.
    """
    files = trace_files(paths)
    if rank is not None and len(files) != 1:
        raise TraceError(f"a rank can be given for one trace only, not {len(files)}")
    traces = [_without_gc(read_trace, p, rank=rank, last_step=last_step) for p in files]
    starts = [t.origin_unix_ms for t in traces]
    ends = [t.origin_unix_ms + max(s.end_ms for s in t.spans) for t in traces]
    if len(traces) > 1 and max(starts) < min(ends):
        origin = min(starts)
        for t in traces:
            t.spans = [s.shifted(origin - t.origin_unix_ms) for s in t.spans]
            t.origin_unix_ms = origin
    return traces


def label(path: str) -> str:
    """A short name of a trace file: its name without the .json/.json.gz suffix."""
    name = os.path.basename(path)
    for suffix in TRACE_SUFFIXES[::-1]:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name
