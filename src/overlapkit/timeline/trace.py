"""Read a PyTorch profiler (Kineto) Chrome trace into the spans the report measures overlap on.

A GPU trace gives one span per kernel, memcpy and memset, on its CUDA stream. A kernel is
communication when its name is an NCCL/RCCL kernel's (`ncclKernel_*`, `ncclDevKernel_*`,
`rccl*`) or when it was launched inside an overlapkit `overlapkit.comm.<kind>` range, which is
how copy-engine transfers (symmetric memory) are told apart from ordinary copies. Collective
name, message size and group size come from the kernel's args or from the matching
`record_param_comms` op; the step from the `ProfilerStep#N` range its launch fell in.

A CPU-only trace (gloo) has no kernels: its computation is the overlapkit
`overlapkit.compute.<name>` ranges and its communication the `gloo:<collective>` ranges,
which run from the start to the end of the transfer on gloo's threads.

The last `ProfilerStep` is dropped when a trace holds two or more (a profiler usually stops
inside it), as HolisticTraceAnalysis does; `last_step=True` keeps it.
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

from .spans import COMM_RANGE_PREFIX, COMPUTE, COMPUTE_RANGE_PREFIX, Span

GPU_CATEGORIES = {"kernel": "kernel", "gpu_memcpy": "memcpy", "memcpy": "memcpy",
                  "gpu_memset": "memset", "memset": "memset"}
LAUNCH_CATEGORIES = {"cuda_runtime", "cuda_driver", "runtime", "driver"}
_COMM_KERNEL = re.compile(r"^(?:nccl|rccl)", re.IGNORECASE)
_KERNEL_COLLECTIVE = re.compile(r"^(?:nccl|rccl)(?:Dev)?Kernel_([A-Za-z]+)", re.IGNORECASE)
_DTYPE_BYTES = {"float": 4, "float32": 4, "half": 2, "float16": 2, "bfloat16": 2, "double": 8,
                "float64": 8, "int": 4, "int32": 4, "long": 8, "int64": 8, "short": 2,
                "int16": 2, "char": 1, "byte": 1, "int8": 1, "uint8": 1, "bool": 1}
_STEP = re.compile(r"^ProfilerStep#(\d+)$")


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
    """'gpu' (kernels and copies) or 'cpu' (overlapkit and gloo ranges)."""


def collective_kind(name: str) -> str:
    """`allreduce`, `_allgather_base`, `AllReduce`, `gloo:all_reduce` -> `all_reduce` and so on."""
    n = name.split(":", 1)[-1]
    n = re.sub(r"(?<=[a-z])(?=[A-Z])", "_", n).lower().strip("_")
    for suffix in ("_coalesced", "_into_tensor", "_tensor", "_base", "_single"):
        n = n.replace(suffix, "")
    aliases = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
               "alltoall": "all_to_all", "alltoallv": "all_to_all", "all_to_allv": "all_to_all",
               "sendrecv": "send_recv", "recv_": "recv", "generic": "nccl"}
    n = n.strip("_")
    return aliases.get(n, n) or "nccl"


class _Ranges:
    """Named time ranges per thread; finds the innermost one holding a time stamp.

    Ranges of one thread nest like a call stack, so the innermost range holding a time is the
    last one started before it, or the nearest enclosing range of that one.
    """

    def __init__(self) -> None:
        self._by_tid: dict[object, list[tuple[float, float, dict]]] = {}

    def add(self, tid, start: float, end: float, value: dict) -> None:
        self._by_tid.setdefault(tid, []).append((start, end, value))

    def freeze(self) -> None:
        self._starts, self._parent = {}, {}
        for tid, rows in self._by_tid.items():
            rows.sort(key=lambda r: (r[0], -r[1]))
            parent, stack = [], []
            for i, (start, end, _) in enumerate(rows):
                while stack and rows[stack[-1]][1] < start:
                    stack.pop()
                parent.append(stack[-1] if stack else -1)
                stack.append(i)
            self._starts[tid], self._parent[tid] = [r[0] for r in rows], parent

    def find(self, tid, ts: float) -> dict | None:
        rows = self._by_tid.get(tid)
        if not rows:
            return None
        i = bisect.bisect_right(self._starts[tid], ts) - 1
        while i >= 0 and rows[i][1] < ts:
            i = self._parent[tid][i]
        return rows[i][2] if i >= 0 else None

    def all(self) -> list[tuple[object, float, float, dict]]:
        return [(t, s, e, v) for t, rows in self._by_tid.items() for s, e, v in rows]


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
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceError(f"{path}: not a trace: not JSON ({e})") from None


def _message(meta: dict) -> tuple[int, int]:
    """(message bytes, group size) from collective metadata; 0 where unknown."""
    elems = max(int(meta.get("In msg nelems", 0) or 0), int(meta.get("Out msg nelems", 0) or 0))
    itemsize = _DTYPE_BYTES.get(str(meta.get("dtype", "")).lower(), 0)
    return elems * itemsize, int(meta.get("Group size", 0) or 0)


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

    gpu, launches, steps = [], {}, []
    ranges, param_comms, param_by_ext, gloo = _Ranges(), _Ranges(), {}, []
    for e in events:
        if e.get("ph") != "X" or "ts" not in e:
            continue
        cat, name, args = str(e.get("cat", "")).lower(), str(e.get("name", "")), e.get("args") or {}
        ts, dur = float(e["ts"]), float(e.get("dur", 0) or 0)
        if cat in GPU_CATEGORIES:
            gpu.append((GPU_CATEGORIES[cat], name, ts, ts + dur, args))
        elif cat in LAUNCH_CATEGORIES and "correlation" in args:
            launches[args["correlation"]] = (e.get("tid"), ts)
        elif cat.startswith("gpu_"):
            continue  # gpu_user_annotation: GPU images of CPU ranges, not work of their own
        elif (m := _STEP.match(name)) is not None:
            steps.append((ts, ts + dur, int(m.group(1))))
        elif name.startswith(COMM_RANGE_PREFIX) or name.startswith(COMPUTE_RANGE_PREFIX):
            ranges.add(e.get("tid"), ts, ts + dur, {"name": name, "ts": ts})
        elif name == "record_param_comms":
            param_comms.add(e.get("tid"), ts, ts + dur, args)
            if "External id" in args:
                param_by_ext[args["External id"]] = args
        elif name.startswith("gloo:"):
            gloo.append((e.get("tid"), ts, ts + dur, name))
    ranges.freeze()
    param_comms.freeze()
    steps.sort()

    if gpu:
        raw = _gpu_spans(gpu, launches, ranges, param_comms, param_by_ext)
        device = "gpu"
    else:
        raw = _cpu_spans(ranges, gloo)
        device = "cpu"
    if not raw:
        raise TraceError(f"{path}: no GPU kernels, memcpy or memset, and no overlapkit or gloo ranges: nothing to analyze")

    info = meta.get("distributedInfo") or {}
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

    def step_of(t: float) -> int | None:
        i = bisect.bisect_right(step_starts, t) - 1
        return steps[i][2] if i >= 0 and t <= steps[i][1] else None

    origin = min(r[1].start_ms for r in raw)
    spans = sorted((_place(s, origin, rank, step_of(issued)) for issued, s in raw),
                   key=lambda s: (s.start_ms, s.end_ms))
    kept = sorted({s.step for s in spans if s.step is not None})
    return Trace(path=str(path), rank=rank, world_size=info.get("world_size"), spans=spans,
                 origin_unix_ms=(base_us + origin) / 1e3, steps=kept, dropped_step=dropped,
                 device=device)


def _place(s: Span, origin_us: float, rank: int, step: int | None) -> Span:
    """A span held in raw trace microseconds, moved to ms from the origin."""
    return Span(kind=s.kind, name=s.name, stream=s.stream, start_ms=(s.start_ms - origin_us) / 1e3,
                end_ms=(s.end_ms - origin_us) / 1e3, rank=rank, nbytes=s.nbytes,
                group_size=s.group_size, step=step)


def _range_label(name: str) -> tuple[str, str]:
    """('comm', kind) or ('compute', name) for an overlapkit range name."""
    if name.startswith(COMM_RANGE_PREFIX):
        return "comm", name[len(COMM_RANGE_PREFIX):].split(":", 1)[0]
    return "compute", name[len(COMPUTE_RANGE_PREFIX):]


def _gpu_spans(gpu, launches, ranges, param_comms, param_by_ext) -> list[tuple[float, Span]]:
    """(launch time, span in raw µs) for every kernel, memcpy and memset."""
    devices = {a.get("device") for _, _, _, _, a in gpu}
    out = []
    for what, name, start, end, args in gpu:
        launch = launches.get(args.get("correlation"))
        issued = launch[1] if launch else start
        stream = f"stream {args.get('stream', '?')}"
        if len(devices) > 1:
            stream = f"gpu {args.get('device')} {stream}"
        rng = ranges.find(launch[0], launch[1]) if launch else None
        label = _range_label(rng["name"]) if rng else (None, None)
        kind, span_name, nbytes, group = COMPUTE, name, 0, 0
        if what != "kernel":
            kind, nbytes = what, int(args.get("bytes", 0) or 0)
        elif _COMM_KERNEL.match(name):
            kind, nbytes, group = _nccl_kind(name, args, launch, param_comms, param_by_ext)
        elif label[0] == "compute":
            span_name = label[1]
        if label[0] == "comm":
            kind = label[1]  # our own range names the transfer, whatever ran it
        out.append((issued, Span(kind=kind, name=span_name, stream=stream, start_ms=start,
                                 end_ms=end, nbytes=nbytes, group_size=group)))
    return out


def _nccl_kind(name, args, launch, param_comms, param_by_ext) -> tuple[str, int, int]:
    """(collective, message bytes, group size) of an NCCL kernel: its args, its op, or its name."""
    meta = args if "Collective name" in args else param_by_ext.get(args.get("External id"))
    if (meta is None or "Collective name" not in meta) and launch:
        meta = param_comms.find(*launch)
    if meta is not None and "Collective name" in meta:
        return (collective_kind(str(meta["Collective name"])),) + _message(meta)
    m = _KERNEL_COLLECTIVE.match(name)
    return (collective_kind(m.group(1)) if m else "nccl"), 0, 0


def _cpu_spans(ranges: _Ranges, gloo) -> list[tuple[float, Span]]:
    """(issue time, span in raw µs) from overlapkit compute ranges and gloo transfer ranges."""
    out, issued = [], []
    for tid, start, end, value in ranges.all():
        what, label = _range_label(value["name"])
        if what == "compute":
            out.append((start, Span(kind=COMPUTE, name=label, stream=f"thread {tid}",
                                    start_ms=start, end_ms=end)))
        else:
            value.update(kind=label, claimed=False)
            issued.append(value)
    issued.sort(key=lambda v: v["ts"])
    first_free = 0
    for tid, start, end, name in sorted(gloo, key=lambda g: g[1]):
        owner = ranges.find(tid, start)  # send/recv run inside their own issue range
        if owner is None or "kind" not in owner:
            # A worker-thread transfer belongs to the earliest unclaimed range issued before it:
            # gloo runs one process group's works in issue order.
            while first_free < len(issued) and issued[first_free]["claimed"]:
                first_free += 1
            ok = first_free < len(issued) and issued[first_free]["ts"] <= start
            owner = issued[first_free] if ok else None
        if owner is not None:
            owner["claimed"] = True
        kind = owner["kind"] if owner is not None else collective_kind(name)
        out.append((owner["ts"] if owner is not None else start,
                    Span(kind=kind, name=name, stream=f"thread {tid}", start_ms=start, end_ms=end)))
    return out


def read_traces(paths, rank: int | None = None, last_step: bool = False) -> list[Trace]:
    """Read several ranks' traces onto one time axis when they overlap in time, else each from 0.

    Traces of one job share the wall clock, so their spans line up; traces that never overlap
    in time (different jobs) would be years apart on one axis, so each keeps its own origin.
    """
    if rank is not None and len(paths) != 1:
        raise TraceError(f"a rank can be given for one trace only, not {len(paths)}")
    traces = [read_trace(p, rank=rank, last_step=last_step) for p in paths]
    starts = [t.origin_unix_ms for t in traces]
    ends = [t.origin_unix_ms + max(s.end_ms for s in t.spans) for t in traces]
    if len(traces) > 1 and max(starts) < min(ends):
        origin = min(starts)
        for t in traces:
            t.spans = [s.shifted(origin - t.origin_unix_ms) for s in t.spans]
            t.origin_unix_ms = origin
    return traces
