"""The order in which each pipeline rank runs its forwards (F), input-gradient backwards (B) and
weight-gradient backwards (W): 1F1B and interleaved 1F1B keep one micro-batch's transfer in flight
while another computes; the zero-bubble schedules (ZB-H1, ZB-V) and DualPipeV also move the weight
gradients, which nothing downstream waits for, into what was the bubble; DualPipeV pairs the
forward of one micro-batch with the backward of another so that each one's communication runs
under the other's compute. GPipe is the simple reference.

Pure functions of (schedule, pp, v, m): every rank computes every rank's order, so that it knows,
without talking, which transfer it sends or receives when (timetable.py). An order is a list of
slots; a slot is one action, or two or three that run together: (B, W) of one micro-batch is a full
backward (the weight gradients computed in the same pass), and (F, B, W) of two different
micro-batches is DualPipeV's overlapped forward-and-backward pair.

Where the chunks live: "loop" (Megatron's interleaving: rank r holds chunks r, r+pp, ...) or "v"
(two chunks a rank, r and 2pp-1-r: the pipeline goes down the ranks and comes back up, so the last
chunk, with the loss, sits on rank 0 beside the first).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..vocabulary import positive_int

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb1p", "zbv", "dualpipev")
"""Schedules the engine runs."""

SPLIT_SCHEDULES = ("zb1p", "zbv", "dualpipev")
"""Schedules that run the weight gradients (W) apart from the input gradients (B)."""

V_SCHEDULES = ("zbv", "dualpipev")
"""Schedules whose two chunks per rank are placed in a V (rank r holds r and 2pp-1-r)."""


@dataclass(frozen=True)
class Action:
    """One forward ("F"), input-gradient backward ("B") or weight-gradient backward ("W") of one
    micro-batch through one chunk of layers. In the non-split schedules "B" is the whole backward."""

    op: str
    """"F", "B" or "W"."""
    mb: int
    """Micro-batch index, 0 .. m-1."""
    chunk: int
    """Global chunk (virtual stage) index, 0 .. pp*v-1 (which rank holds it: `rank_of`)."""


Slot = tuple  # tuple[Action, ...]: what one rank runs in one tick


def placement(schedule: str) -> str:
    """"v" for the V-shaped schedules, else "loop"."""
    return "v" if schedule in V_SCHEDULES else "loop"


def rank_of(chunk: int, pp: int, style: str = "loop") -> int:
    """The pipeline rank that holds global chunk `chunk`."""
    if style == "v":
        return chunk if chunk < pp else 2 * pp - 1 - chunk
    return chunk % pp


def local_index(chunk: int, pp: int, style: str = "loop") -> int:
    """Position of global chunk `chunk` among its rank's chunks."""
    return (0 if chunk < pp else 1) if style == "v" else chunk // pp


def chunks_of(rank: int, pp: int, v: int, style: str = "loop") -> list[int]:
    """Global chunks of `rank`, in local order."""
    if style == "v":
        return [rank, 2 * pp - 1 - rank]
    return [k * pp + rank for k in range(v)]


def check_schedule(schedule: str, pp: int, v: int, m: int) -> None:
    """Raise ValueError naming the value when (schedule, pp, v, m) cannot run."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule={schedule!r} is not one of {SCHEDULES}")
    for name, value in (("pp", pp), ("virtual_stages", v), ("microbatches", m)):
        positive_int(value, f"pipeline {name}")
    if schedule in ("1f1b", "zb1p"):
        if v != 1:
            raise ValueError(f"schedule {schedule!r} runs one chunk per rank: virtual_stages={v} needs "
                             f"'interleaved-1f1b'{' or zbv' if schedule == 'zb1p' else ''}")
        if m < pp:
            raise ValueError(f"schedule {schedule!r} needs microbatches >= pp: microbatches={m} < pp={pp} "
                             "(fewer micro-batches than stages never reach the steady state)")
    if schedule == "interleaved-1f1b" and (m < pp or m % pp):
        raise ValueError(f"schedule 'interleaved-1f1b' needs microbatches to be a multiple of pp: "
                         f"microbatches={m}, pp={pp} (micro-batches go round the ring in groups of pp)")
    if schedule in V_SCHEDULES:
        if v != 2:
            raise ValueError(f"schedule {schedule!r} runs two chunks per rank in a V: virtual_stages={v} must be 2")
        if pp < 2:
            raise ValueError(f"schedule {schedule!r} needs pp >= 2, got pp={pp}")
    if schedule == "dualpipev" and m < 2 * pp:
        raise ValueError(f"schedule 'dualpipev' needs microbatches >= 2*pp: microbatches={m} < {2 * pp} "
                         "(its steady state pairs a forward with a backward of each chunk)")


def rank_slots(schedule: str, pp: int, v: int, m: int, rank: int,
               costs: tuple[float, float, float] = (1.0, 1.0, 1.0), *, split_backward: bool = False) -> list[Slot]:
    """The slots of `rank` in the order it runs them. `costs`: relative durations of a chunk's F, B
    and W, which zbv builds its order for (the other schedules have one order whatever the costs).
    `split_backward` (gpipe, 1f1b, interleaved-1f1b): each backward becomes its input gradient (B),
    then at once its weight gradients (W), so the gradient leaves for the previous rank before the
    weight-gradient GEMMs run; the order and the micro-batches in flight stay the schedule's."""
    check_schedule(schedule, pp, v, m)
    check_costs(costs)
    if split_backward and schedule in SPLIT_SCHEDULES:
        raise ValueError(f"split_backward: schedule {schedule!r} already places its weight gradients itself")
    if split_backward:
        return [s for a in _classic(schedule, pp, v, m, rank)
                for s in (((a,), (Action("W", a.mb, a.chunk),)) if a.op == "B" else ((a,),))]
    if schedule == "zb1p":
        return _zb_h1(pp, m, rank)
    if schedule == "zbv":
        return _zbv(pp, m, tuple(float(c) for c in costs))[rank]
    if schedule == "dualpipev":
        return _dualpipev(pp, m, rank)
    return [(a,) for a in _classic(schedule, pp, v, m, rank)]


def rank_actions(schedule: str, pp: int, v: int, m: int, rank: int,
                 costs: tuple[float, float, float] = (1.0, 1.0, 1.0), *, split_backward: bool = False) -> list[Action]:
    """The actions of `rank` in the order it runs them (the slots, flattened)."""
    return [a for slot in rank_slots(schedule, pp, v, m, rank, costs, split_backward=split_backward) for a in slot]


def check_costs(costs) -> None:
    """Raise ValueError unless `costs` is three finite numbers > 0 (a chunk's F, B and W durations)."""
    ok = isinstance(costs, (tuple, list)) and len(costs) == 3 and all(
        isinstance(c, (int, float)) and not isinstance(c, bool) and 0 < c < float("inf") for c in costs)
    if not ok:
        raise ValueError(f"pipeline costs={costs!r} must be three finite numbers > 0: the relative durations of a "
                         "chunk's forward, input-gradient backward and weight-gradient backward")


def _classic(schedule: str, pp: int, v: int, m: int, rank: int) -> list[Action]:
    chunk = lambda local: local * pp + rank  # noqa: E731 (rank holds chunks rank, rank+pp, ...)
    if schedule == "gpipe":
        # Every forward (chunk by chunk), then every backward in reverse chunk order.
        out = [Action("F", i, chunk(k)) for k in range(v) for i in range(m)]
        return out + [Action("B", i, chunk(k)) for k in reversed(range(v)) for i in range(m)]
    if schedule == "1f1b":
        warmup = min(pp - rank - 1, m)
        return _one_f_one_b([Action("F", i, rank) for i in range(m)], [Action("B", i, rank) for i in range(m)], warmup)
    # Interleaved (Megatron): micro-batches go through the rank's chunks in groups of pp.
    total = m * v

    def fwd_k(k: int) -> Action:
        return Action("F", (k // (pp * v)) * pp + k % pp, chunk((k // pp) % v))

    def bwd_k(k: int) -> Action:
        return Action("B", (k // (pp * v)) * pp + k % pp, chunk(v - 1 - (k // pp) % v))

    warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    return _one_f_one_b([fwd_k(k) for k in range(total)], [bwd_k(k) for k in range(total)], warmup)


def _one_f_one_b(fwd: list[Action], bwd: list[Action], warmup: int) -> list[Action]:
    out = fwd[:warmup]
    for k in range(len(fwd) - warmup):
        out += [fwd[warmup + k], bwd[k]]
    return out + bwd[len(fwd) - warmup:]


def _zb_h1(pp: int, m: int, rank: int) -> list[Slot]:
    """ZB-H1: 1F1B with its backward split, rank r postponing its first r weight gradients.

    1F1B's warm-up (pp-1-r forwards) and steady state (one F, one B); a W follows each steady-state
    B once r of them are pending, and the pending ones run in the cool-down, where 1F1B's rank r
    waits for the next gradient. A micro-batch is held from its F to its W: at most pp on every
    rank, 1F1B's peak (its first rank's), of which the pending W's keep only the GEMM inputs.
    """
    warmup = min(pp - rank - 1, m)
    out: list[Slot] = [(Action("F", i, rank),) for i in range(warmup)]
    b = w = 0

    def backward() -> None:
        nonlocal b, w
        out.append((Action("B", b, rank),))
        b += 1
        if b > rank:  # r weight gradients stay pending
            out.append((Action("W", w, rank),))
            w += 1

    for i in range(warmup, m):
        out.append((Action("F", i, rank),))
        backward()
    while b < m:
        backward()
    out += [(Action("W", i, rank),) for i in range(w, m)]
    return out


def _zbv(pp: int, m: int, costs: tuple[float, float, float]) -> list[list[Slot]]:
    """ZB-V: an event-driven list schedule of every rank at once (two chunks a rank, in a V), with
    `costs` = the durations of a chunk's F, B and W.

    Whenever a rank is free it starts, of what can start soonest: the oldest input gradient B (it
    unblocks the previous chunk), else the next forward, later chunk first (it leads to the loss
    sooner), while the rank holds fewer than 2·pp chunk-micro-batches (a micro-batch counts from its
    F to its W: 1F1B's peak, pp stage activations), else the oldest pending weight gradient W — so W
    runs exactly where the rank would otherwise wait. With F = B = W the steady state has no bubble;
    with other costs the order adapts to them (all ranks must be given the same costs).
    """
    n, inf = 2 * pp, float("inf")
    dur = dict(zip("FBW", costs))
    end: dict[tuple[str, int, int], float] = {}
    orders: list[list[Slot]] = [[] for _ in range(pp)]
    mine = [chunks_of(r, pp, 2, "v") for r in range(pp)]
    next_f = [{c: 0 for c in mine[r]} for r in range(pp)]
    next_b = [{c: 0 for c in mine[r]} for r in range(pp)]
    pending_w: list[list[Action]] = [[] for _ in range(pp)]
    alive, free = [0] * pp, [0.0] * pp

    def inputs_at(a: Action) -> float:
        keys = [("F", a.chunk - 1, a.mb)] if a.op == "F" and a.chunk > 0 else []
        if a.op == "B":
            keys = [("F", a.chunk, a.mb)] + ([("B", a.chunk + 1, a.mb)] if a.chunk < n - 1 else [])
        return max((end.get(k, inf) for k in keys), default=0.0)

    def candidates(r: int):  # (start, priority, action)
        out = [(max(free[r], inputs_at(a)), (0, a.mb, -a.chunk), a)
               for a in (Action("B", next_b[r][c], c) for c in mine[r] if next_b[r][c] < m)]
        if alive[r] < 2 * pp:
            out += [(max(free[r], inputs_at(a)), (1, -a.chunk, 0), a)
                    for a in (Action("F", next_f[r][c], c) for c in mine[r] if next_f[r][c] < m)]
        if pending_w[r]:
            out.append((free[r], (2, 0, 0), pending_w[r][0]))
        return [c for c in out if c[0] < inf]

    for _ in range(pp * 6 * m):
        best = None
        for r in range(pp):
            cands = candidates(r)
            if cands:
                t0 = min(c[0] for c in cands)
                pick = min((c for c in cands if c[0] <= t0), key=lambda c: c[1])
                if best is None or (t0, r) < best[0]:
                    best = ((t0, r), pick[2])
        if best is None:  # cannot happen (every allowed (pp, m) is simulated in the tests); never loop forever
            raise AssertionError(f"zbv with pp={pp}, m={m} stalls")
        (t0, r), a = best
        end[(a.op, a.chunk, a.mb)] = free[r] = t0 + dur[a.op]
        orders[r].append((a,))
        if a.op == "F":
            next_f[r][a.chunk] += 1
            alive[r] += 1
        elif a.op == "B":
            next_b[r][a.chunk] += 1
            pending_w[r].append(Action("W", a.mb, a.chunk))
        else:
            pending_w[r].pop(0)
            alive[r] -= 1
    return orders


def _dualpipev(pp: int, m: int, rank: int) -> list[Slot]:
    """DeepSeek's DualPipeV (the "cut-in-half" DualPipe): chunk a = rank on the way down, chunk
    b = 2pp-1-rank on the way back up. Phases: forwards of a; of a and b alternately; b's backward
    split (B, then its W) beside b's forwards; the steady state of overlapped pairs — the forward of
    one chunk with the full backward of the other; then the cool-down, whose later backwards leave
    their W for the end, where the bubble was."""
    a, b = rank, 2 * pp - 1 - rank
    nf = {a: 0, b: 0}
    nb = {a: 0, b: 0}
    w_queue: list[Action] = []
    out: list[Slot] = []

    def fwd(c):
        nf[c] += 1
        return Action("F", nf[c] - 1, c)

    def bwd(c, split: bool):
        nb[c] += 1
        act = Action("B", nb[c] - 1, c)
        if split:
            w_queue.append(Action("W", act.mb, c))
            return (act,)
        return (act, Action("W", act.mb, c))

    def pending_w():
        if w_queue:
            out.append((w_queue.pop(0),))

    for _ in range(2 * (pp - rank - 1)):
        out.append((fwd(a),))
    for _ in range(rank + 1):
        out += [(fwd(a),), (fwd(b),)]
    for _ in range(pp - rank - 1):
        out.append(bwd(b, split=True))
        pending_w()
        out.append((fwd(b),))
    for i in range(m - 2 * pp + rank + 1):
        if i == 0 and rank == pp - 1:
            out += [(fwd(a),), bwd(b, split=False)]  # the turn of the V: b's input is a's output, not yet paired
        else:
            out.append((fwd(a),) + bwd(b, split=False))
        out.append((fwd(b),) + bwd(a, split=False))
    for _ in range(pp - rank - 1):
        out.append(bwd(b, split=False))
        out.append((fwd(b),) + bwd(a, split=False))
    split = False
    for i in range(rank + 1):
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        out.append(bwd(b, split))
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        out.append(bwd(a, split))
    for _ in range(pp - rank - 1):
        pending_w()
        out.append(bwd(a, split))
    while w_queue:
        pending_w()
    return out
