"""Per-GEMM choice of TP overlap: none, bulk or pipelined, and how many chunks.

A TP collective meets a GEMM in one of four patterns:

- `ag_gemm`  all-gather whose output the GEMM consumes (column-parallel input, row-parallel
  backward): pipelined, chunk j of the GEMM runs as soon as its rows landed;
- `gemm_rs`  reduce-scatter of the GEMM's output (row-parallel forward): pipelined, each
  chunk's partial sums leave while the next chunk computes;
- `gemm_ar`  all-reduce of the output without sequence parallelism: on the critical path;
- `beside`   a collective next to an *independent* GEMM (backward dgrad/wgrad): bulk.

Every candidate is priced on the stream simulator with chunk GEMMs of m/chunks rows, so the
chunking loss (QKV at TP 8 keeps 0.92 of its speed at 4 chunks, 0.67 at 8 on H200) and the
contention of the transport are in the price. `auto` takes the cheapest.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import _validate as v
from .collectives import Collectives, Group
from .hardware import DTYPE_BYTES, Hardware, load_hardware
from .overlap import ag_gemm_ms, bulk_ms, gemm_rs_ms, ring_pieces

PATTERNS = ("ag_gemm", "gemm_rs", "gemm_ar", "beside")
COMM_KIND = {"all_gather": "tp_all_gather", "reduce_scatter": "tp_reduce_scatter", "all_reduce": "tp_all_reduce"}
"""Timeline kind of each TP collective."""
SMALL_CHUNK_ROWS = 64
"""At or below this many rows a GEMM runs at under a third of peak (H200: 189 TFLOP/s at m=64)."""


@dataclass(frozen=True)
class Site:
    """One place where a TP collective meets a GEMM."""

    name: str
    """Label, e.g. 'fc1 fwd'."""
    phase: str
    """'fwd' or 'bwd'."""
    pattern: str
    """One of PATTERNS."""
    collective: str
    """all_gather, reduce_scatter or all_reduce."""
    nbytes: int
    """Collective size (nccl-tests convention: gathered output / input before scatter)."""
    m: int
    """Rows of the GEMM it meets (the dependent GEMM, or for `beside` the independent one)."""
    k: int
    """That GEMM's reduction size."""
    n: int
    """That GEMM's columns on this rank."""


@dataclass(frozen=True)
class SiteChoice:
    """What the planner chose for a site, and the prices it compared."""

    site: Site
    mode: str
    """none, bulk or pipelined."""
    chunks: int
    """GEMM chunks (1 unless pipelined)."""
    gemm_ms: float
    """The GEMM's compute: whole, or its chunks' sum when chunking happens to run faster."""
    comm_ms: float
    """The collective alone."""
    time_ms: float
    """Wall time of GEMM and collective under the chosen mode (contention included)."""
    options: tuple[tuple[str, int, float], ...]
    """Every (mode, chunks, time_ms) priced."""
    note: str = ""
    """Why overlap cannot help here, when it cannot."""
    chunk_ms: float = 0.0
    """Pipelined: one GEMM chunk alone."""
    piece_ms: float = 0.0
    """Pipelined: one ring piece's transfer."""
    contention: float = 1.0
    """GEMM slowdown beside this site's transfers."""
    group_size: int = 1
    """Ranks in the TP group."""

    @property
    def exposed_ms(self) -> float:
        """Time beyond the GEMM alone: un-hidden communication plus contention."""
        return self.time_ms - self.gemm_ms

    @property
    def kind(self) -> str:
        return COMM_KIND[self.site.collective]


def chunk_candidates(m: int, tp: int) -> list[int]:
    """Chunk counts a ring exchange can use: divisors or multiples of tp that split m evenly."""
    cands = {2, 4, 8, 16, 32, 64, tp, 2 * tp, 4 * tp, 8 * tp}
    return sorted(c for c in cands if c > 1 and (c % tp == 0 or tp % c == 0) and m % c == 0)


def _pipelined_parts(site: Site, hw: Hardware, coll: Collectives, group: Group, dtype: str,
                     chunks: int) -> tuple[float, float]:
    """(one GEMM chunk, one ring piece's transfer), milliseconds."""
    pieces, _ = ring_pieces(chunks, group.size)
    return (hw.gemm_ms(site.m // chunks, site.k, site.n, dtype),
            coll.time_ms("send_recv", site.nbytes / pieces, Group(2, 2)))


def _price_pipelined(site: Site, hw: Hardware, coll: Collectives, group: Group, transport: str,
                     dtype: str, chunks: int) -> float:
    chunk_ms, piece_ms = _pipelined_parts(site, hw, coll, group, dtype, chunks)
    fn = ag_gemm_ms if site.pattern == "ag_gemm" else gemm_rs_ms
    return fn(chunk_ms, chunks, group.size, piece_ms, hw.comm_slowdown(transport), COMM_KIND[site.collective])


def plan_site(site: Site, hw: Hardware, coll: Collectives, group: Group, setting: str,
              transport: str = "p2p", dtype: str = "bf16") -> SiteChoice:
    """Price every way to run the site and pick per `setting` (none, bulk, pipelined, auto)."""
    v.one_of("Site", "pattern", site.pattern, PATTERNS)
    gemm = hw.gemm_ms(site.m, site.k, site.n, dtype)
    comm = coll.time_ms(site.collective, site.nbytes, group)
    options = [("none", 1, gemm + comm)]
    if site.pattern == "beside":
        options.append(("bulk", 1, bulk_ms(comm, gemm, hw.sm_comm_slowdown)))
    elif site.pattern in ("ag_gemm", "gemm_rs") and group.size > 1:
        for c in chunk_candidates(site.m, group.size):
            options.append(("pipelined", c, _price_pipelined(site, hw, coll, group, transport, dtype, c)))
    allowed = {"none": ("none",), "bulk": ("none", "bulk"), "pipelined": ("bulk", "pipelined"),
               "auto": ("none", "bulk", "pipelined")}[setting]
    pool = [o for o in options if o[0] in allowed] or options[:1]
    mode, chunks, time = min(pool, key=lambda o: (o[2], o[1]))
    chunk_ms, piece_ms = (_pipelined_parts(site, hw, coll, group, dtype, chunks) if mode == "pipelined"
                          else (gemm, comm))
    contention = hw.comm_slowdown(transport) if mode == "pipelined" else hw.sm_comm_slowdown
    # A chunking loss is a cost of the overlap (exposed); a chunking gain is compute, not hidden comm.
    compute = min(gemm, chunks * chunk_ms) if mode == "pipelined" else gemm
    return SiteChoice(site, mode, chunks, compute, comm, time, tuple(options), _why_not(site, gemm, comm, options),
                      chunk_ms, piece_ms, contention, group.size)


def _why_not(site: Site, gemm: float, comm: float, options) -> str:
    """A short reason when overlap cannot hide this site's collective."""
    if site.pattern == "gemm_ar":
        return "all-reduce on the critical path: turn on sequence parallelism to make it overlappable"
    best_overlap = min((o for o in options if o[0] != "none"), key=lambda o: o[2], default=None)
    if best_overlap is None:
        return ""
    if best_overlap[2] >= options[0][2]:
        rows = site.m // best_overlap[1]
        if best_overlap[0] == "pipelined" and rows <= SMALL_CHUNK_ROWS:
            return f"chunks of {rows} rows (m <= {SMALL_CHUNK_ROWS}) run far below peak: pipelining loses"
        return f"overlap loses here: best {best_overlap[0]} {best_overlap[2]:.3f} ms vs {options[0][2]:.3f} ms sequential"
    if comm > gemm:
        return f"T_comm {comm:.3f} ms > T_gemm {gemm:.3f} ms: at most {gemm:.3f} ms can hide"
    return ""


def choose_tp_overlap(m: int, k: int, n: int, tp: int, dtype_bytes: int, hardware="h200-sxm", *,
                      comm: str = "all_gather", beside: bool = False, transport: str = "p2p",
                      nbytes: int | None = None) -> tuple[str, int]:
    """Best TP overlap for one GEMM (m x k) @ (k x n) on one of `tp` ranks -> (mode, chunks).

    `m` is the full (gathered) row count, `k` and `n` the rank's weight shard. `comm` is the
    collective: all_gather before the GEMM (column-parallel) or reduce_scatter after it
    (row-parallel); it moves the GEMM's input (m x k) or output (m x n) unless `nbytes` says
    otherwise. With `beside=True` the collective is independent of this GEMM (backward
    dgrad/wgrad) and the answer is bulk or none. `transport` is how pipelined chunks move:
    p2p (NCCL, takes SMs) or symm_mem (copy engines). Returns ('none', 1), ('bulk', 1) or
    ('pipelined', chunks). What an engine's overlap="auto" asks.
    """
    v.one_of("choose_tp_overlap", "comm", comm, ("all_gather", "reduce_scatter"))
    v.one_of("choose_tp_overlap", "dtype_bytes", dtype_bytes, (1, 2, 4))
    for f, val in (("m", m), ("k", k), ("n", n), ("tp", tp)):
        v.positive_int("choose_tp_overlap", f, val)
    hw = load_hardware(hardware)
    if tp == 1:
        return "none", 1
    if tp > hw.gpus_per_node:
        raise v.ConfigError(f"choose_tp_overlap.tp={tp} exceeds gpus_per_node={hw.gpus_per_node} of {hw.name}")
    dtype = {1: "fp8", 2: "bf16", 4: "fp32"}[dtype_bytes]
    pattern = "beside" if beside else ("ag_gemm" if comm == "all_gather" else "gemm_rs")
    if nbytes is None:
        nbytes = m * (k if comm == "all_gather" else n) * DTYPE_BYTES[dtype]
    site = Site("gemm", "fwd", pattern, comm, nbytes, m, k, n)
    choice = plan_site(site, hw, Collectives(hw), Group(tp, tp), "auto", transport, dtype)
    return choice.mode, choice.chunks
