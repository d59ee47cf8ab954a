"""FSDP2's own all-gathers and reduce-scatters, issued through `overlapkit.runtime.comm` so the timeline
sees them: each block's parameter gather (`zero_all_gather`) overlaps the compute of the blocks
before it, its gradient reduce-scatter (`zero_reduce_scatter`) the backward of the blocks after.

FSDP2 issues its collectives itself; its `set_custom_all_gather` / `set_custom_reduce_scatter`
hooks (torch >= 2.8) let us issue them instead, with the same tensors, group and reduce op,
through `comm` (so the recorder and a profiler trace name them, per block and pass). Every
gather is issued asynchronously and handed back to FSDP2 as a `Work` whose `wait()` is
`comm.Handle.wait()`: FSDP2 waits for it right before the block's first use (its copy-out),
so the stretch a rank stalls there is marked blocked (not compute) on the stream or thread
that stalled. FSDP2 accepts a Work whatever `async_op` it asked for (it is its
`unshard(async_op=True)` path). On CPU this is what makes prefetch mean anything: a
synchronous gather would hold the host, which has no side stream. A reduce-scatter is
consumed by FSDP2 right after the call (on its reduce-scatter stream), so it is waited inside
the call, as FSDP2 would.

`Probe` times one step for `prefetch="auto"`; `layer_report` (timeline/fsdp2.py, which also reads
plain FSDP2's collectives from a profiler trace) turns spans into how much of each block's gathers
and reduce-scatters hid.
"""

from __future__ import annotations


import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from ..runtime import clock, comm
from ..runtime.clock import elapsed_ms
from ..runtime.agreement import raise_explained
from ..timeline.fsdp2 import GATHER_KIND, REDUCE_KIND, LayerComm, layer_report

__all__ = ["GATHER_KIND", "REDUCE_KIND", "LayerComm", "Probe", "RecordedAllGather", "RecordedReduceScatter",
           "layer_report"]


def _phase() -> str:
    """'backward' inside an autograd graph task (FSDP2's backward re-gathers), else 'forward'."""
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


class Probe:
    """Stamps of one training step at prefetch depth 0, when every gather is waited right after issue.

    Off (one attribute read per collective) except during the probed step. Times resolve in
    `times()` (a CUDA synchronize there).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.on = False
        self._side = torch.cuda.Stream(device) if self.cuda else None
        self.reset()

    def reset(self) -> None:
        self.comms: list[list] = []  # [kind, phase, start, end]
        self.stalls: dict[str, list[tuple]] = {"forward": [], "backward": []}
        self.passes: dict[str, list[list]] = {"forward": [], "backward": []}  # [start, end] of each pass

    def stamp(self):
        return clock.stamp(self.cuda)

    def done_stamp(self, work: dist.Work):
        """The completion of `work` (CUDA: an event on a side stream that waits for it; CPU: None, filled at wait)."""
        if not self.cuda:
            return None
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            work.wait()
            return self.stamp()

    def times(self) -> dict[str, float]:
        """Mean gather_ms and reduce_ms per collective; per phase the wall and stall ms summed over
        its passes and the number of passes (a pipeline stage runs several micro-batches per probe)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        out: dict[str, float] = {}
        for kind, key in ((GATHER_KIND, "gather"), (REDUCE_KIND, "reduce")):
            for phase in ("forward", "backward"):
                ms = [elapsed_ms(s, e) for k, p, s, e in self.comms if k == kind and p == phase and e is not None]
                out[f"{phase}_{key}_ms"] = sum(ms) / len(ms) if ms else 0.0
                out[f"{phase}_{key}_count"] = float(len(ms))
        for phase in ("forward", "backward"):
            done = [(a, b) for a, b in self.passes[phase] if b is not None]
            out[f"{phase}_wall_ms"] = sum(elapsed_ms(a, b) for a, b in done)
            out[f"{phase}_passes"] = float(len(done))
            out[f"{phase}_stall_ms"] = sum(elapsed_ms(s, e) for s, e in self.stalls[phase])
        return out


class _HandleWork(dist.distributed_c10d.Work):
    """A `Work` FSDP2 can wait on that is an overlapkit `Handle` (so the wait is on the timeline)."""

    def __init__(self, handle: comm.Handle, probe: Probe, entry: list | None, phase: str, stalls: bool = True,
                 group=None, doing: str = "") -> None:
        super().__init__()
        self._handle, self._probe, self._entry, self._phase = handle, probe, entry, phase
        self._stalls = stalls  # whether the waiting stream (or thread) is the compute's
        self._group, self._doing = group, doing

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - FSDP2 passes none; the group's timeout applies
        probe = self._probe
        t0 = probe.stamp() if probe.on else None
        try:
            self._handle.wait()
        except Exception as e:  # noqa: BLE001 - a rank that broke step may have said why
            raise_explained(self._group, "fully_shard", e, self._doing)
        if t0 is not None:
            t1 = probe.stamp()
            if self._stalls:
                probe.stalls[self._phase].append((t0, t1))
            if self._entry is not None and self._entry[3] is None:
                self._entry[3] = t1
        return True

    def is_completed(self) -> bool:
        return self._handle.is_completed()


class RecordedAllGather(AllGather):
    """FSDP2's all-gather of one block's parameter shards, named `<block> forward|backward` on the timeline."""

    def __init__(self, name: str, probe: Probe) -> None:
        self.name, self.probe = name, probe

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work:
        phase = _phase()
        probe = self.probe
        start = probe.stamp() if probe.on else None
        works: list = []

        def issue():
            works.append(comm.dist_all_gather_tensor(output_tensor, input_tensor, group=group, async_op=True))
            return works

        nbytes = output_tensor.numel() * output_tensor.element_size()
        handle = comm.launch(GATHER_KIND, f"{self.name} {phase}", nbytes, group, issue)
        entry = None
        if start is not None:
            entry = [GATHER_KIND, phase, start, probe.done_stamp(works[0])]
            probe.comms.append(entry)
        return _HandleWork(handle, probe, entry, phase, group=group, doing=f"the all-gather of {self.name} ({phase})")


class RecordedReduceScatter(ReduceScatter):
    """FSDP2's gradient reduce-scatter of one block, named `<block>` on the timeline; done when it returns."""

    def __init__(self, name: str, probe: Probe) -> None:
        self.name, self.probe = name, probe

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        probe = self.probe
        start = probe.stamp() if probe.on else None
        works: list = []

        def issue():
            works.append(comm.dist_reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=True))
            return works

        nbytes = input_tensor.numel() * input_tensor.element_size()
        handle = comm.launch(REDUCE_KIND, self.name, nbytes, group, issue)
        # On CUDA this waits on FSDP2's reduce-scatter stream, which stalls no compute.
        work = _HandleWork(handle, probe, None, "backward", stalls=not probe.cuda, group=group,
                           doing=f"the gradient reduce-scatter of {self.name}")
        if start is not None:
            entry = [REDUCE_KIND, "backward", start, probe.done_stamp(works[0])]
            probe.comms.append(entry)
            work._entry = entry
        if async_op:
            return work
        # FSDP2 reads the output right after this call (on its reduce-scatter stream). On CPU the
        # host waits here; on CUDA the reduce-scatter stream does, not the compute stream.
        work.wait()
        return None
