"""A `Block`: the work of one layer (or the LM head) for one micro-batch in one phase, priced.

Compute, the communication it meets, what of that stays exposed, and one report row per GEMM,
site or op: what the step model adds up per stage and micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .planner import SiteChoice


@dataclass
class Block:
    """Work of one layer (or the LM head) for one micro-batch, in one phase."""

    compute_ms: float = 0.0
    """Pure compute: every GEMM, attention and memory-bound op, nothing else."""
    wall_ms: float = 0.0
    """Time on the critical path: compute plus what its collectives leave exposed."""
    comm: dict = field(default_factory=dict)
    """Communication time per kind."""
    exposed: dict = field(default_factory=dict)
    """Exposed time per kind."""
    rows: list = field(default_factory=list)
    """Report rows, one per GEMM/site/op."""

    def add_compute(self, name: str, ms: float) -> None:
        self.compute_ms += ms
        self.wall_ms += ms
        self.rows.append({"op": name, "time_ms": ms, "gemm_ms": ms})

    def add_comm(self, kind: str, comm_ms: float, exposed_ms: float) -> None:
        self.comm[kind] = self.comm.get(kind, 0.0) + comm_ms
        self.exposed[kind] = self.exposed.get(kind, 0.0) + exposed_ms
        self.wall_ms += exposed_ms

    def add_site(self, c: SiteChoice) -> None:
        self.compute_ms += c.gemm_ms
        self.wall_ms += c.gemm_ms
        self.add_comm(c.kind, c.comm_ms, c.exposed_ms)
        s = c.site
        self.rows.append({"op": s.name, "m": s.m, "k": s.k, "n": s.n, "gemm_ms": c.gemm_ms,
                          "comm": c.kind, "comm_ms": c.comm_ms, "pattern": s.pattern, "mode": c.mode,
                          "chunks": c.chunks, "time_ms": c.time_ms, "exposed_ms": c.exposed_ms, "note": c.note,
                          "chunk_ms": c.chunk_ms, "piece_ms": c.piece_ms, "contention": c.contention,
                          "group_size": c.group_size, "nbytes": s.nbytes})

    def scaled(self, times: float) -> "Block":
        return Block(self.compute_ms * times, self.wall_ms * times,
                     {k: x * times for k, x in self.comm.items()},
                     {k: x * times for k, x in self.exposed.items()}, self.rows)

    def __add__(self, other: "Block") -> "Block":
        keys = set(self.comm) | set(other.comm)
        return Block(self.compute_ms + other.compute_ms, self.wall_ms + other.wall_ms,
                     {k: self.comm.get(k, 0.0) + other.comm.get(k, 0.0) for k in keys},
                     {k: self.exposed.get(k, 0.0) + other.exposed.get(k, 0.0) for k in keys},
                     self.rows + other.rows)
