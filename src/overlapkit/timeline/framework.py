"""What a trace says about the job that made it: framework, device, and what it already does.

Advice is only useful when it fits: telling a DDP job to "reduce gradients during backward" or
blaming "a slow GPU" on a CPU job is worse than saying nothing. The reader tags the names of
the CPU ranges and launches it meets (`tag`), counting each tag per trace (`Trace.evidence`);
`Job.of(traces)` turns the counts into what the diagnosis may rely on:

| tag | seen as | means |
|---|---|---|
| ddp | `torch::distributed::reducer::*`, `torch.distributed.ddp.reducer::*`, `DistributedDataParallel.forward` | torch DDP: its reducer all-reduces gradient buckets during backward |
| fsdp | `FSDP::*` ranges, `FullyShardedDataParallel.*` | torch FSDP (FSDP2's `fully_shard`, or FSDP1) |
| fsdp_prefetch | `FSDP::forward_prefetch …` | FSDP2 explicit forward prefetch is on (`FSDP::backward_prefetch …` is FSDP2's default) |
| overlapkit | `overlapkit.comm.*`, `overlapkit.compute.*`, `overlapkit.wait` | overlapkit's engines |
| deepspeed | a name holding `deepspeed` | DeepSpeed |
| megatron | a name holding `megatron` | Megatron-LM / Megatron-Core |
| cuda_graph | `cudaGraphLaunch`, `hipGraphLaunch` | CUDA/HIP graphs already replay the step's kernels |
| compiled | `Torch-Compiled Region`, `CompiledFunction`, `CompiledFxGraph`, `triton_*` kernels | torch.compile is on |
| loader_single / loader_workers | `_SingleProcessDataLoaderIter` / `_MultiProcessingDataLoaderIter` | DataLoader without / with worker processes |
| host_sync | `cudaDeviceSynchronize`, `cudaStreamSynchronize`, `cudaEventSynchronize` (and hip…) | the host blocked on the GPU |
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..runtime import state

_PREFIXES = (
    ("torch::distributed::reducer::", "ddp"), ("torch.distributed.ddp.reducer::", "ddp"),
    ("DistributedDataParallel.forward", "ddp"),
    ("FSDP::forward_prefetch", "fsdp_prefetch"),
    ("FSDP::", "fsdp"), ("FullyShardedDataParallel", "fsdp"),
    ("overlapkit.", "overlapkit"),
    ("Torch-Compiled Region", "compiled"), ("CompiledFunction", "compiled"), ("## Call CompiledFxGraph", "compiled"),
    ("triton_", "compiled"),
    ("cudaGraphLaunch", "cuda_graph"), ("hipGraphLaunch", "cuda_graph"),
    ("cudaDeviceSynchronize", "host_sync"), ("cudaStreamSynchronize", "host_sync"),
    ("cudaEventSynchronize", "host_sync"), ("hipDeviceSynchronize", "host_sync"),
    ("hipStreamSynchronize", "host_sync"), ("hipEventSynchronize", "host_sync"),
)
_INSIDE = (("_SingleProcessDataLoaderIter", "loader_single"), ("_MultiProcessingDataLoaderIter", "loader_workers"),
           ("deepspeed", "deepspeed"), ("megatron", "megatron"))
_cache: dict[str, str | None] = state.cache_dict("trace.framework_of_name")
_CACHE_MAX = 1 << 16
HOST_SYNCS = frozenset(n for n, t in _PREFIXES if t == "host_sync")
"""Runtime calls in which the host waits for the GPU."""
GRAPH_LAUNCHES = frozenset({"cudaGraphLaunch", "hipGraphLaunch"})
"""Runtime calls that replay a captured graph (one correlation id for all its kernels)."""
KERNEL_LAUNCH = "LaunchKernel"
"""In the name of every runtime call that queues one kernel (cudaLaunchKernel, cuLaunchKernelEx, hipLaunchKernel…)."""
TYPICAL_LAUNCHES = 16
"""Kernel launches a trace needs before its median launch time is taken as what a launch costs the host."""


def launch_waits(launches: list) -> list:
    """(thread, start, end) of the host's waits inside kernel launches: a launch that took over twice the
    trace's median launch waited, beyond the median, for room in the GPU's launch queue (full when the host
    runs far ahead of the GPU). That is a wait for the GPU, like a synchronization, not dispatch work; counted
    as dispatch, it would price the host of a GPU-bound step at the GPU's pace. Jitter within twice the median
    stays dispatch."""
    if len(launches) < TYPICAL_LAUNCHES:
        return []
    durations = sorted(b - a for _, a, b in launches)
    median = durations[len(durations) // 2]
    return [(t, a + median, b) for t, a, b in launches if b - a > 2 * median]


def tag(name: str) -> str | None:
    """The evidence tag of a CPU range, op or launch name (see the module's table), or None."""
    got = _cache.get(name, 0)
    if got != 0:
        return got
    found = next((t for p, t in _PREFIXES if name.startswith(p)), None)
    if found is None:
        low = name.lower()
        found = next((t for s, t in _INSIDE if s.lower() in low), None)
    if len(_cache) < _CACHE_MAX:
        _cache[name] = found
    return found


@dataclass(frozen=True)
class Job:
    """What the traces of one job show about it (the diagnosis advises nothing already on)."""

    device: str
    """'gpu' or 'cpu' (no GPU activity in any trace)."""
    frameworks: tuple[str, ...]
    """ddp, fsdp, overlapkit, deepspeed, megatron — those seen, in that order."""
    evidence: dict = field(default_factory=dict)
    """Tag -> count over all traces."""

    @classmethod
    def of(cls, traces) -> "Job":
        counts: dict[str, int] = {}
        for t in traces:
            for k, v in (getattr(t, "evidence", None) or {}).items():
                counts[k] = counts.get(k, 0) + v
        device = "gpu" if any(t.device == "gpu" for t in traces) else "cpu"
        names = tuple(f for f in ("ddp", "fsdp", "overlapkit", "deepspeed", "megatron") if counts.get(f))
        return cls(device=device, frameworks=names, evidence=counts)

    def has(self, what: str) -> bool:
        return bool(self.evidence.get(what))

    @property
    def gpu(self) -> bool:
        return self.device == "gpu"

    def describe(self) -> str:
        names = {"ddp": "torch DDP", "fsdp": "torch FSDP", "overlapkit": "overlapkit engines",
                 "deepspeed": "DeepSpeed", "megatron": "Megatron"}
        what = ", ".join(names[f] for f in self.frameworks) or "no framework recognised"
        extra = [x for x, on in (("CUDA graphs", self.has("cuda_graph")), ("torch.compile", self.has("compiled")),
                                 ("FSDP2 forward prefetch", self.has("fsdp_prefetch")),
                                 ("DataLoader workers", self.has("loader_workers"))) if on]
        return f"{self.device.upper()} job; {what}" + (f"; already on: {', '.join(extra)}" if extra else "")
