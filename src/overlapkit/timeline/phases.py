"""Which phase of a training step issued a transfer: forward, backward, optimizer, or a pipeline wait.

Which phase the costly collectives run in matters, because the switch that hides
them differs: backward all-reduces hide behind the rest of backward (buckets), forward
gathers behind earlier layers (prefetch), pipeline transfers behind the other micro-batch.
The phase of a span is read from the CPU range open on the issuing thread when it was issued:

| range open at issue | phase |
|---|---|
| `Optimizer.*` (torch's optimizer hooks), a user range starting with `optimizer` | optimizer |
| `autograd::engine::evaluate_function: *`, `overlapkit.compute.backward`, `## ...backward... ##` | backward |
| `overlapkit.compute.forward`, `## ...forward... ##`, or nothing of the above, inside a `ProfilerStep` | forward |

Point-to-point transfers (send/recv, pp_send/pp_recv) are `pipeline bubble` whatever was open:
their exposed time is a stage waiting for its neighbour. An NCCL `SendRecv` kernel without
collective metadata (`send_recv`) is not: NCCL runs all-to-all as grouped send/recv too, so it
keeps the phase of its launch. Spans outside every step get no phase.
"""

from __future__ import annotations

FORWARD, BACKWARD, OPTIMIZER, PIPELINE = "forward", "backward", "optimizer", "pipeline bubble"
PHASES = (FORWARD, BACKWARD, OPTIMIZER, PIPELINE)
"""Every phase a span can have, in step order."""
P2P_KINDS = frozenset({"send", "recv", "send_recv", "pp_send", "pp_recv"})
"""Point-to-point kinds: not matched across ranks as collectives."""
PIPELINE_KINDS = frozenset({"send", "recv", "pp_send", "pp_recv"})
"""Point-to-point kinds that are the pipeline's transfers."""


def marker_phase(name: str) -> str | None:
    """The phase a CPU range's name marks, or None when it marks none."""
    low = name.lower()
    if name.startswith("Optimizer.") or low.startswith("optimizer"):
        return OPTIMIZER
    if (name.startswith("autograd::engine::evaluate_function") or name == "overlapkit.compute.backward"
            or (low.startswith("## ") and "backward" in low)):
        return BACKWARD
    if name == "overlapkit.compute.forward" or (low.startswith("## ") and "forward" in low):
        return FORWARD
    return None


def span_phase(kind: str, marked: str | None, in_step: bool) -> str | None:
    """The phase of a span of `kind` issued under a range marking `marked` (None: none marked)."""
    if kind in PIPELINE_KINDS:
        return PIPELINE
    if marked is not None:
        return marked
    return FORWARD if in_step else None


def exposed_by_phase(rank: int, spans, compute_known: bool = True, top: int = 3) -> list[dict]:
    """The `top` collectives (kind, message size) with the most exposed time, per phase, of one rank.

    Exposed = |union of those spans \\ union of all compute| (the report's definition, per group).
    Rows: {rank, phase, kind, nbytes, count, comm_ms, exposed_ms}; none when compute is unknown.
    """
    from collections import defaultdict

    from ..runtime import intervals as iv

    if not compute_known:
        return []
    compute = iv.union((s.start_ms, s.end_ms) for s in spans if s.is_compute)
    groups = defaultdict(list)
    for s in spans:
        if s.is_comm:
            groups[(s.phase or "outside steps", s.kind, s.nbytes)].append(s)
    rows = []
    for (phase, kind, nbytes), ss in groups.items():
        comm = iv.union((s.start_ms, s.end_ms) for s in ss)
        rows.append(dict(rank=rank, phase=phase, kind=kind, nbytes=nbytes, count=len(ss), comm_ms=iv.length(comm),
                         exposed_ms=iv.length(iv.subtract(comm, compute))))
    order = {p: i for i, p in enumerate(PHASES + ("outside steps",))}
    out = []
    for phase in sorted({r["phase"] for r in rows}, key=order.get):
        out += sorted((r for r in rows if r["phase"] == phase), key=lambda r: -r["exposed_ms"])[:top]
    return out
