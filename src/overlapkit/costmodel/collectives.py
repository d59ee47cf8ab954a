"""How long a collective takes: the communication that overlap has to hide.

Alpha-beta costs (Hockney): a step costs `alpha`, a byte costs `1 / bus bandwidth`.
Sizes follow nccl-tests: all-reduce and all-to-all count one rank's buffer, all-gather the
gathered output, reduce-scatter the input before scattering.

    ring all-reduce   2(n-1)·alpha + 2(n-1)/n · S / B
    tree all-reduce   2·ceil(log2 n)·alpha + 2 · S / B
    all-gather / reduce-scatter / all-to-all   (n-1)·alpha + (n-1)/n · S / B
    send/recv         alpha + S / B

A group that spans nodes with r ranks per node runs hierarchically: all-reduce is an
intra-node reduce-scatter, an inter-node all-reduce of S/r among the r parallel rings, and an
intra-node all-gather. A measured nccl-tests table, when given, replaces the formula for its
collective and group size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import _validate as v
from .hardware import Hardware, Link

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
"""Collectives the model prices."""


def _flat(kind: str, nbytes: float, n: int, link: Link, algo: str = "ring") -> float:
    """Milliseconds of one collective over a single tier."""
    if n <= 1 and kind != "send_recv":
        return 0.0
    alpha, bus = link.alpha_us * 1e-3, link.bus_gbps * 1e6  # ms and bytes per ms
    if kind == "all_reduce":
        if algo == "tree":
            return 2 * math.ceil(math.log2(n)) * alpha + 2 * nbytes / bus
        return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / bus
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) * alpha + (n - 1) / n * nbytes / bus
    return alpha + nbytes / bus


@dataclass(frozen=True)
class NcclTable:
    """A measured nccl-tests run: message size -> time, for one collective and group size."""

    kind: str
    """Which collective (one of KINDS)."""
    ranks: int
    """Group size it was measured on."""
    points: tuple[tuple[int, float], ...]
    """(size in bytes, out-of-place time in microseconds), sorted by size."""

    def __post_init__(self) -> None:
        v.one_of("NcclTable", "kind", self.kind, KINDS)
        v.positive_int("NcclTable", "ranks", self.ranks)
        if len(self.points) < 2:
            raise v.ConfigError(f"NcclTable({self.kind}).points: {len(self.points)} rows; need at least 2")

    def time_ms(self, nbytes: float) -> float:
        """Log-log interpolation; beyond the largest size, the largest size's bandwidth."""
        pts = self.points
        if nbytes <= pts[0][0]:
            return pts[0][1] * 1e-3
        if nbytes >= pts[-1][0]:
            return pts[-1][1] * nbytes / pts[-1][0] * 1e-3
        for (s0, t0), (s1, t1) in zip(pts, pts[1:]):
            if s0 <= nbytes <= s1:
                w = math.log(nbytes / s0) / math.log(s1 / s0)
                return math.exp(math.log(t0) + w * math.log(t1 / t0)) * 1e-3
        raise AssertionError("unreachable: sizes are sorted")


def parse_nccl_tests(text: str, kind: str, ranks: int | None = None) -> NcclTable:
    """Read nccl-tests output (e.g. all_reduce_perf); ranks from its '#  Rank' lines if not given."""
    rows, seen_ranks = {}, 0
    for line in text.splitlines():
        f = line.split()
        if line.lstrip().startswith("#") and len(f) > 2 and f[1] == "Rank":
            seen_ranks += 1
        elif len(f) >= 8 and f[0].isdigit():
            try:
                rows[int(f[0])] = float(f[5])
            except ValueError:
                continue
    ranks = ranks or seen_ranks
    if not ranks:
        raise v.ConfigError(f"nccl-tests table for {kind}: no '#  Rank' lines; give the group size")
    rows = {s: t for s, t in rows.items() if s > 0 and t > 0}
    return NcclTable(kind, ranks, tuple(sorted(rows.items())))


@dataclass(frozen=True)
class Group:
    """Where a communicator's ranks sit."""

    size: int
    """Ranks in the group."""
    per_node: int
    """Ranks of the group that share one node (1: every rank on its own node)."""

    @classmethod
    def strided(cls, size: int, stride: int, gpus_per_node: int) -> "Group":
        """A group of ranks `stride` apart (TP stride 1, DP stride tp, PP stride tp·dp)."""
        per_node = max(1, gpus_per_node // stride) if stride < gpus_per_node else 1
        return cls(size, min(size, per_node))

    @property
    def spans_nodes(self) -> bool:
        return self.size > self.per_node


class Collectives:
    """Prices collectives on one piece of hardware, with optional measured tables."""

    def __init__(self, hardware: Hardware, tables: tuple[NcclTable, ...] = ()) -> None:
        self.hw = hardware
        self.tables = {(t.kind, t.ranks): t for t in tables}

    def time_ms(self, kind: str, nbytes: float, group: Group, algo: str = "auto") -> float:
        """Milliseconds for one `kind` collective of `nbytes` (nccl-tests convention) on `group`."""
        v.one_of("Collectives", "kind", kind, KINDS)
        if nbytes <= 0 or (group.size <= 1 and kind != "send_recv"):
            return 0.0
        table = self.tables.get((kind, group.size))
        if table is not None:
            return table.time_ms(nbytes)
        intra, inter = self.hw.intra, self.hw.inter
        if kind == "send_recv":
            return _flat(kind, nbytes, 2, inter if group.spans_nodes else intra)
        if not group.spans_nodes:
            return self._best(kind, nbytes, group.size, intra, algo)
        r, nodes = group.per_node, group.size // group.per_node
        if r == 1:
            return self._best(kind, nbytes, nodes, inter, algo)
        if kind == "all_to_all":  # the intra- and inter-node shares of the buffer move at once
            n = group.size
            on_node = (r - 1) * intra.alpha_us * 1e-3 + nbytes * (r - 1) / n / (intra.bus_gbps * 1e6)
            off_node = (nodes - 1) * inter.alpha_us * 1e-3 + nbytes * (n - r) / n / (inter.bus_gbps * 1e6)
            return max(on_node, off_node)
        within = {"all_reduce": ("reduce_scatter", "all_gather"), "all_gather": (None, "all_gather"),
                  "reduce_scatter": ("reduce_scatter", None)}[kind]
        t = self._best(kind, nbytes / r, nodes, inter, algo)
        return t + sum(_flat(w, nbytes, r, intra) for w in within if w)

    def _best(self, kind: str, nbytes: float, n: int, link: Link, algo: str) -> float:
        if kind != "all_reduce" or algo == "ring":
            return _flat(kind, nbytes, n, link)
        if algo == "tree":
            return _flat(kind, nbytes, n, link, "tree")
        return min(_flat(kind, nbytes, n, link), _flat(kind, nbytes, n, link, "tree"))
