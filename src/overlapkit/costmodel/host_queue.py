"""The GPU's wait for its host: the host dispatches ahead of the work through CUDA's launch queue.

A step's kernels are launched by the host in order; the GPU runs each as soon as it is launched and the one
before it is done. So the GPU waits for its host only when the host has fallen behind over the whole stretch
so far, not in every layer whose dispatch outlasts its work: where a stretch of work is long and its dispatch
short (the LM head and its loss, a large backward layer), the host gets ahead and later host-heavy layers
spend that lead first. The lead is bounded: a launch blocks while `LAUNCH_QUEUE_OPS` launches wait in the
queue (`timeline.framework.launch_waits` reads those blocked launches off a trace as waits for the GPU).

Pricing each layer's dispatch against its own work alone (no lead carried from one layer to the next) is the
upper bound of this, and what a step with a synchronization in every layer would pay.
"""

from __future__ import annotations

LAUNCH_QUEUE_OPS = 1024
"""Launches the host may have queued ahead of the GPU before the next launch blocks (the depth of CUDA's
launch queue, about a thousand kernels): how far dispatch can run ahead of the work."""


def queue_wait_ms(units: list[tuple[float, float, int]]) -> float:
    """The time the GPU waits for its host over `units` in launch order, each (host ms to dispatch it, GPU ms
    of its work, ops it launches).

    A unit's work ends no sooner than its last launch and no sooner than the work before it ends plus its own;
    its last launch is no sooner than the host's previous launch plus its dispatch, nor than the end of the
    unit whose completion leaves the queue room for it. The wait is the GPU's end less its work."""
    host_end = gpu_end = work = 0.0
    launched = 0
    ends: list[tuple[int, float]] = []  # (ops launched through a unit, the GPU's end of that unit)
    room, freed = 0, 0.0  # units whose completion has been counted for the queue, and the latest such end
    for host_ms, gpu_ms, ops in units:
        launched += ops
        while room < len(ends) and ends[room][0] <= launched - LAUNCH_QUEUE_OPS:
            freed = ends[room][1]
            room += 1
        host_end = max(host_end + host_ms, freed)
        gpu_end = max(gpu_end + gpu_ms, host_end)
        work += gpu_ms
        ends.append((launched, gpu_end))
    return max(0.0, gpu_end - work)
