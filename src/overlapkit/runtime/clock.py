"""The one clock every measurement here reads: an event on the current stream on CUDA (the device's
time, taken without waiting for it), the host's perf_counter elsewhere."""

from __future__ import annotations

import time

import torch


def stamp(cuda: bool):
    """A time stamp: a recorded CUDA event on the current stream if `cuda`, else the host clock (s)."""
    if cuda:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def elapsed_ms(a, b) -> float:
    """Milliseconds from stamp `a` to stamp `b` (both from `stamp`, on the same kind of clock)."""
    if isinstance(a, float):
        return (b - a) * 1e3
    return a.elapsed_time(b)
