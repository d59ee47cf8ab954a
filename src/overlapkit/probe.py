"""`overlapkit doctor --probe`: does a transfer on a side stream really run beside a GEMM here?

An async API is no proof of overlap. This times a bf16 GEMM alone, a transfer alone on a
side stream, and both issued together, on this GPU with this process's
CUDA_DEVICE_MAX_CONNECTIONS, and reports the share of the shorter one that disappeared:
1 = fully hidden, 0 = serialized (below 0 = worse than serialized: the two slowed each other).
Host-to-device copies run on the copy engines and usually hide; a device-to-device copy or
any SM kernel competes with the GEMM for the SMs and usually does not — which is why
overlapkit's symm_mem transport pulls with the copy engines.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Concurrency:
    """One transfer measured beside a GEMM."""

    transfer: str
    """What moved: its path and which engine moves it."""
    gemm_ms: float
    """The GEMM alone (median)."""
    transfer_ms: float
    """The transfer alone on the side stream (median)."""
    both_ms: float
    """Both issued together, from the first start to the last end (median)."""

    @property
    def hidden_fraction(self) -> float:
        return hidden_fraction(self.gemm_ms, self.transfer_ms, self.both_ms)

    @property
    def verdict(self) -> str:
        return verdict(self.hidden_fraction)


def hidden_fraction(a_ms: float, b_ms: float, both_ms: float) -> float:
    """Share of the shorter of two operations that vanished when they ran together."""
    shorter = min(a_ms, b_ms)
    if shorter <= 0:
        raise ValueError(f"operation times must be > 0, got {a_ms} and {b_ms}")
    return (a_ms + b_ms - both_ms) / shorter


def verdict(fraction: float) -> str:
    if fraction >= 0.8:
        return "overlaps"
    if fraction > 0.2:
        return "partly overlaps"
    return "serialized"


def _median_ms(fn, side: torch.cuda.Stream, reps: int) -> float:
    """Median time of fn() (which may use `side`), main stream joined with the side stream."""
    main = torch.cuda.current_stream()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record(main)
        side.wait_stream(main)
        fn()
        main.wait_stream(side)
        end.record(main)
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(device: torch.device | None = None, n: int = 8192, reps: int = 10) -> list[Concurrency]:
    """The GEMM beside each kind of transfer, sized so that both take a similar time."""
    if not torch.cuda.is_available():
        raise RuntimeError("the overlap probe needs a CUDA device: on CPU there is no side stream to measure")
    device = device or torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    side = torch.cuda.Stream(device)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)

    def gemm():
        a @ b

    gemm()
    gemm_ms = _median_ms(gemm, side, reps)
    out = []
    for label, make in (("host -> device copy (copy engine)", _h2d), ("device -> device copy (SM kernel)", _d2d)):
        xfer = make(device, side, mbytes=64)
        per_mb = _median_ms(xfer, side, 3) / 64
        # Size the transfer to last about as long as the GEMM: the hidden share is then clearest.
        mbytes = max(1, min(4096, int(gemm_ms / max(per_mb, 1e-6))))
        xfer = make(device, side, mbytes)
        xfer_ms = _median_ms(xfer, side, reps)

        def both(xfer=xfer):
            xfer()
            gemm()

        out.append(Concurrency(label, gemm_ms, xfer_ms, _median_ms(both, side, reps)))
    return out


def _h2d(device, side, mbytes: int):
    src = torch.empty(mbytes << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(mbytes << 20, dtype=torch.uint8, device=device)

    def xfer():
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
    return xfer


def _d2d(device, side, mbytes: int):
    src = torch.empty(mbytes << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def xfer():
        with torch.cuda.stream(side):
            dst.copy_(src)
    return xfer
