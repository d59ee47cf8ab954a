"""FSDP2's own collectives in a profiler trace: each module's parameter all-gather (which prefetch
hides behind the neighbouring modules' forward or backward) and its gradient reduce-scatter (hidden
behind the rest of backward), named by module, and how much of each module's hid.

torch's `fully_shard` (FSDP2, torch 2.4 to 2.13 alike) opens a `record_function` range around
each module's collectives: `FSDP::all_gather (<fqn>)` around the copy-in and the all-gather,
`FSDP::post_backward_reduce (<fqn>)` around the chunk-cat, the reduce-scatter (and HSDP's
all-reduce) and the division; the root module's ranges carry no `(<fqn>)`, and torch 2.13 adds
` [pg=N]` when a module has several parameter groups. The gathers run inside `FSDP::pre_forward`,
`FSDP::forward_prefetch for ...` (forward) or `FSDP::pre_backward`, `FSDP::backward_prefetch for ...`
(backward). Only the collective issued inside such a range (a gloo/c10d op, an NCCL kernel) takes
the ZeRO-3 kind; FSDP2's copy-in, copy-out and chunk-cat kernels stay computation.

On a CPU trace the host thread runs FSDP2's hooks: what a hook range holds beyond the CPU ops in
it is the host issuing or waiting for a collective (a synchronous gloo gather, `Work.wait()`),
never computation, even inside an enclosing autograd op (`blocked_in_hooks`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..runtime import intervals as iv

GATHER_KIND = "zero_all_gather"
REDUCE_KIND = "zero_reduce_scatter"
HSDP_KIND = "dp_all_reduce"
"""HSDP's all-reduce across replicas of a module's reduce-scattered gradient."""
ROOT = "(root)"
"""The name given to the root module's parameters (outside every wrapped block)."""
RANGE_PREFIX = "FSDP::"
_COLLECTIVE_RANGE = re.compile(r"^FSDP::(all_gather|post_backward_reduce)(?: \((?P<fqn>.*?)\))?(?: \[pg=\d+\])?$")


def is_fsdp_range(name: str) -> bool:
    """A range FSDP2 opened (its hooks and collectives)."""
    return name.startswith(RANGE_PREFIX)


def fsdp2_comm(chain: list[str], collective: str) -> tuple[str, str] | None:
    """(kind, span name) of a `collective` (all_gather, reduce_scatter, all_reduce) issued inside the
    FSDP2 ranges `chain` (innermost first), or None when no FSDP2 collective range holds it.

    Gathers are named `<module> forward|backward`, reduce-scatters `<module>`, as overlapkit's
    recorder names ZeRO-3 spans, so `layer_report` reads both.
    """
    for i, name in enumerate(chain):
        if (m := _COLLECTIVE_RANGE.match(name)) is not None:
            break
    else:
        return None
    module = m.group("fqn") or ROOT
    if m.group(1) == "all_gather":
        if collective != "all_gather":
            return None
        phase = "backward" if any("backward" in n for n in chain[i + 1:]) else "forward"
        return GATHER_KIND, f"{module} {phase}"
    if collective == "reduce_scatter":
        return REDUCE_KIND, module
    if collective == "all_reduce":
        return HSDP_KIND, module
    return None


def blocked_in_hooks(fsdp_ranges, compute_ops) -> dict:
    """Per thread: the time FSDP2's hook ranges held beyond the computation ops inside them.

    fsdp_ranges: (tid, start, end) of every `FSDP::` range; compute_ops: (tid, start, end) of the
    CPU ops that compute. An op inside a hook range (copy-in, chunk-cat) is computation; the rest
    of the range is the host issuing or waiting for a collective.
    """
    by_tid: dict[object, list] = {}
    for tid, a, b in fsdp_ranges:
        by_tid.setdefault(tid, []).append((a, b))
    hooks = {tid: iv.union(pairs) for tid, pairs in by_tid.items()}
    inside: dict[object, list] = {}
    for tid, a, b in compute_ops:
        for s, e in hooks.get(tid, ()):
            if s <= a and b <= e:
                inside.setdefault(tid, []).append((a, b))
                break
    return {tid: iv.subtract(h, iv.union(inside.get(tid, []))) for tid, h in hooks.items()}


@dataclass(frozen=True)
class LayerComm:
    """How much of one module's ZeRO-3 communication hid behind computation, on one rank."""

    name: str
    """The module (its fqn; `(root)` for the parameters outside every wrapped block)."""
    forward_gather_ms: float
    """Time its forward all-gathers were in flight (union)."""
    forward_gather_exposed_ms: float
    """The part of that no compute span covered."""
    backward_gather_ms: float
    """Time its backward re-gathers were in flight."""
    backward_gather_exposed_ms: float
    """The part of that no compute span covered."""
    reduce_scatter_ms: float
    """Time its gradient reduce-scatters were in flight."""
    reduce_scatter_exposed_ms: float
    """The part of that no compute span covered."""

    @property
    def comm_ms(self) -> float:
        return self.forward_gather_ms + self.backward_gather_ms + self.reduce_scatter_ms

    @property
    def exposed_ms(self) -> float:
        return self.forward_gather_exposed_ms + self.backward_gather_exposed_ms + self.reduce_scatter_exposed_ms

    @property
    def hidden_pct(self) -> float | None:
        return None if self.comm_ms == 0 else 100.0 * (1 - self.exposed_ms / self.comm_ms)


def layer_report(spans, rank: int | None = None) -> list[LayerComm]:
    """Per module, in first-issue order: ZeRO-3 gather and reduce-scatter time, and the part of
    it no compute span of the same rank covered (exposed). `spans` from `record()` or a trace."""
    spans = [s for s in spans if rank is None or s.rank == rank]
    ranks = {s.rank for s in spans}
    if len(ranks) > 1:
        raise ValueError(f"layer_report needs the spans of one rank; got ranks {sorted(ranks)} (pass rank=)")
    compute = iv.union((s.start_ms, s.end_ms) for s in spans if s.is_compute)
    rows: dict[str, dict[str, list]] = {}
    for s in sorted(spans, key=lambda s: s.start_ms):
        if s.kind == GATHER_KIND and s.name.rsplit(" ", 1)[-1] in ("forward", "backward"):
            block, phase = s.name.rsplit(" ", 1)
            key = f"{phase}_gather"
        elif s.kind == REDUCE_KIND and s.name:
            block, key = s.name, "reduce_scatter"
        else:
            continue
        rows.setdefault(block, {}).setdefault(key, []).append((s.start_ms, s.end_ms))
    out = []
    for block, parts in rows.items():
        vals = {}
        for key in ("forward_gather", "backward_gather", "reduce_scatter"):
            m = iv.union(parts.get(key, []))
            vals[f"{key}_ms"] = iv.length(m)
            vals[f"{key}_exposed_ms"] = iv.length(iv.subtract(m, compute))
        out.append(LayerComm(name=block, **vals))
    return out


def layer_table(traces) -> list[tuple[str, list[str], list[list[str]]]]:
    """`overlapkit analyze`'s per-module ZeRO-3 table (title, header, rows); none without ZeRO-3 spans."""
    rows = []
    for t in traces:
        if not t.compute_known:
            continue
        for r in layer_report(t.spans, rank=t.rank):
            hidden = "—" if r.hidden_pct is None else f"{r.hidden_pct:.1f}"
            rows.append([str(t.rank), r.name] + [f"{x:.3f}" for x in (
                r.forward_gather_ms, r.forward_gather_exposed_ms, r.backward_gather_ms, r.backward_gather_exposed_ms,
                r.reduce_scatter_ms, r.reduce_scatter_exposed_ms)] + [hidden])
    if not rows:
        return []
    return [("ZeRO-3 / FSDP2 per module: all-gathers and reduce-scatters, and how much of them hid",
             ["rank", "module", "fwd gather ms", "exposed", "bwd gather ms", "exposed", "reduce-scatter ms",
              "exposed", "hidden %"], rows)]


def layer_json(traces) -> list[dict]:
    """The per-module rows for `overlapkit analyze --json` (with rank and hidden_pct)."""
    from dataclasses import asdict

    return [dict(rank=t.rank, **asdict(r), hidden_pct=r.hidden_pct)
            for t in traces if t.compute_known for r in layer_report(t.spans, rank=t.rank)]
