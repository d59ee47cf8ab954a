"""How fast each collective moved its bytes, against the link's peak, and what bounds it.

Per collective kind, message size and group size: algorithm and bus bandwidth with the
nccl-tests definitions, and latency- or bandwidth-bound from the alpha-beta model of the link
(`Links`, which the caller fills from the cost model's hardware). docs/timeline.md defines
every number.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass

from ..runtime.spans import Span

DEFAULT_ALPHA_US = 5.0
"""Latency per algorithm step assumed when only a peak is given (NCCL's per-step cost on NVLink/IB is 2–10 µs)."""


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor of a collective over n ranks."""
    if n <= 1:
        return 1.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def latency_steps(kind: str, n: int) -> int:
    """Algorithm steps of a ring collective over n ranks (each pays the link latency once)."""
    if kind == "all_reduce":
        return max(1, 2 * (n - 1))
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return max(1, n - 1)
    return 1


@dataclass(frozen=True)
class Link:
    """The link a group's collectives run on: name, peak GB/s per GPU per direction, latency per step."""

    name: str
    peak_gbps: float
    alpha_us: float


@dataclass(frozen=True)
class Links:
    """The links of a machine: inside a node (groups of up to `gpus_per_node` ranks) and between nodes."""

    name: str
    """The hardware's name (a cost-model preset name when it came from one)."""
    gpus_per_node: int
    intra: Link
    inter: Link


def check_peak(peak_gbps) -> None:
    """ValueError unless `peak_gbps` is None or a finite number of GB/s > 0 (a negative or NaN peak would
    print a percent of peak that means nothing)."""
    if peak_gbps is None:
        return
    if isinstance(peak_gbps, bool) or not isinstance(peak_gbps, (int, float)) or not 0 < peak_gbps < math.inf:
        raise ValueError(f"--peak-gbps {peak_gbps!r}: a link's peak is a finite number of GB/s > 0")


def link_for(group_size: int, hw: Links | None = None, peak_gbps: float | None = None) -> Link | None:
    """The link of a group of `group_size` ranks: intra-node if it fits in a node, else the network."""
    if hw is not None:
        tier = hw.intra if group_size <= hw.gpus_per_node else hw.inter
        return Link(tier.name + (" (peak from --peak-gbps)" if peak_gbps else ""),
                    peak_gbps or tier.peak_gbps, tier.alpha_us)
    if peak_gbps:
        return Link(f"--peak-gbps {peak_gbps:g}", peak_gbps, DEFAULT_ALPHA_US)
    return None


@dataclass(frozen=True)
class BandwidthRow:
    """One rank's transfers of one collective kind, message size and group size."""

    rank: int
    kind: str
    nbytes: int
    group_size: int
    count: int
    median_ms: float
    algbw_gbps: float | None
    """S / t, GB/s (10^9 bytes/s); None when the message size is unknown."""
    busbw_gbps: float | None
    """algbw · bus factor, GB/s."""
    peak_gbps: float | None
    """The link's peak, when known."""
    pct_of_peak: float | None
    bound: str | None
    """'bandwidth', 'latency', or None when the link or the size is unknown."""
    link: str | None


def bandwidth_rows(rank: int, spans: list[Span], hw: Links | None = None, peak_gbps: float | None = None) -> list[BandwidthRow]:
    """Bandwidth of every (kind, size, group size) of one rank's communication spans."""
    groups: dict[tuple[str, int, int], list[float]] = defaultdict(list)
    for s in spans:
        if s.is_comm and s.duration_ms > 0:
            groups[(s.kind, s.nbytes, s.group_size)].append(s.duration_ms)
    rows = []
    for (kind, nbytes, n), durations in sorted(groups.items()):
        t_ms = statistics.median(durations)
        alg = bus = peak = pct = bound = None
        link = link_for(n, hw, peak_gbps) if n > 1 else None
        if nbytes > 0:
            alg = nbytes / (t_ms * 1e-3) / 1e9
            bus = alg * bus_factor(kind, n) if n > 0 else None
        if link is not None and bus is not None:
            peak, pct = link.peak_gbps, 100 * bus / link.peak_gbps
            latency_us = latency_steps(kind, n) * link.alpha_us
            bytes_us = nbytes * bus_factor(kind, n) / (link.peak_gbps * 1e3)
            bound = "latency" if latency_us > bytes_us else "bandwidth"
        rows.append(BandwidthRow(rank=rank, kind=kind, nbytes=nbytes, group_size=n, count=len(durations),
                                 median_ms=t_ms, algbw_gbps=alg, busbw_gbps=bus, peak_gbps=peak, pct_of_peak=pct,
                                 bound=bound, link=link.name if link else None))
    return rows
