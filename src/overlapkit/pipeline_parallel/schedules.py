"""The order in which each pipeline rank runs its forwards and backwards, and the timetable of
transfers that order implies: 1F1B and interleaved 1F1B keep one micro-batch's transfer in flight
while another micro-batch computes; GPipe is the simple reference.

Pure functions of (schedule, pp, v, m): every rank computes every rank's order and the same
timetable, so that each rank knows, without talking, which transfer it sends or receives when.
The timetable is a unit-time simulation: at tick t a rank runs its next action if every input
was produced at an earlier tick. Transfers are grouped by the tick that produced them; every
rank issues its transfers tick by tick, so the sends from a to b and the receives b posts from
a come in the same order on both (NCCL matches point-to-point in issue order), and a schedule
whose simulation stalls is refused before anything is sent.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
"""Schedules the engine runs."""


@dataclass(frozen=True)
class Action:
    """One forward ("F") or backward ("B") of one micro-batch through one chunk of layers."""

    op: str
    """"F" or "B"."""
    mb: int
    """Micro-batch index, 0 .. m-1."""
    chunk: int
    """Global chunk (virtual stage) index, 0 .. pp*v-1; rank chunk % pp holds it."""


def check_schedule(schedule: str, pp: int, v: int, m: int) -> None:
    """Raise ValueError naming the value when (schedule, pp, v, m) cannot run."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule={schedule!r} is not one of {SCHEDULES}")
    for name, value in (("pp", pp), ("virtual_stages", v), ("microbatches", m)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"pipeline {name}={value!r} must be an integer >= 1")
    if schedule == "1f1b":
        if v != 1:
            raise ValueError(f"schedule '1f1b' runs one chunk per rank: virtual_stages={v} needs 'interleaved-1f1b'")
        if m < pp:
            raise ValueError(f"schedule '1f1b' needs microbatches >= pp: microbatches={m} < pp={pp} "
                             "(fewer micro-batches than stages never reach the steady state)")
    if schedule == "interleaved-1f1b":
        if m < pp or m % pp:
            raise ValueError(f"schedule 'interleaved-1f1b' needs microbatches to be a multiple of pp: "
                             f"microbatches={m}, pp={pp} (micro-batches go round the ring in groups of pp)")


def rank_actions(schedule: str, pp: int, v: int, m: int, rank: int) -> list[Action]:
    """The actions of `rank` in the order it runs them."""
    check_schedule(schedule, pp, v, m)
    chunk = lambda local: local * pp + rank  # noqa: E731 (rank holds chunks rank, rank+pp, ...)
    if schedule == "gpipe":
        # Every forward (chunk by chunk), then every backward in reverse chunk order.
        out = [Action("F", i, chunk(k)) for k in range(v) for i in range(m)]
        return out + [Action("B", i, chunk(k)) for k in reversed(range(v)) for i in range(m)]
    if schedule == "1f1b":
        warmup = min(pp - rank - 1, m)
        fwd = [Action("F", i, rank) for i in range(m)]
        bwd = [Action("B", i, rank) for i in range(m)]
        return _one_f_one_b(fwd, bwd, warmup)
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


@dataclass(frozen=True)
class Transfer:
    """One activation (forward) or gradient (backward) crossing from one rank to the next."""

    src: int
    dst: int
    tick: int
    """The tick whose action produced it: transfers are issued in tick order on both ends."""
    action: Action
    """The action that consumes it on `dst`."""

    @property
    def tag(self) -> int:
        """A gloo tag unique within a step, so that a receive can only ever match its own send."""
        a = self.action
        return ((a.chunk * 2 + (a.op == "B")) << 20) + a.mb


@dataclass(frozen=True)
class Timetable:
    """When every rank runs each of its actions, and every transfer between ranks."""

    pp: int
    v: int
    m: int
    ticks: list[list[tuple[int, Action]]]
    """Per rank: (tick, action) in run order."""
    transfers: list[Transfer]
    """Every transfer, sorted by (tick, src, dst)."""

    @property
    def n_ticks(self) -> int:
        return 1 + max(t for row in self.ticks for t, _ in row)

    def sends(self, rank: int) -> dict[int, list[Transfer]]:
        """tick -> transfers `rank` sends after that tick's action."""
        return _by_tick(t for t in self.transfers if t.src == rank)

    def recvs(self, rank: int) -> dict[int, list[Transfer]]:
        """tick (of production) -> transfers `rank` receives."""
        return _by_tick(t for t in self.transfers if t.dst == rank)


def _by_tick(transfers) -> dict[int, list[Transfer]]:
    out: dict[int, list[Transfer]] = {}
    for t in transfers:
        out.setdefault(t.tick, []).append(t)
    return out


def _input_of(a: Action, n_chunks: int) -> tuple[str, int] | None:
    """(op, chunk) of the action that produces what `a` needs from another chunk, or None."""
    if a.op == "F":
        return ("F", a.chunk - 1) if a.chunk > 0 else None
    # The backward of the last chunk starts from the loss (its own forward); others need the next chunk's grad.
    return ("B", a.chunk + 1) if a.chunk < n_chunks - 1 else None


def timetable(schedule: str, pp: int, v: int, m: int) -> Timetable:
    """Simulate the schedule on unit-time ticks; raise ValueError if it can never finish."""
    check_schedule(schedule, pp, v, m)
    n_chunks = pp * v
    orders = [rank_actions(schedule, pp, v, m, r) for r in range(pp)]
    done: dict[tuple[str, int, int], int] = {}  # (op, chunk, mb) -> tick it ran
    pos = [0] * pp
    rows: list[list[tuple[int, Action]]] = [[] for _ in range(pp)]
    transfers = []
    tick = 0
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        ran = []
        for r in range(pp):
            if pos[r] == len(orders[r]):
                continue
            a = orders[r][pos[r]]
            need = _input_of(a, n_chunks)
            own = ("F", a.chunk, a.mb) if a.op == "B" else None  # a backward needs its own forward
            if need is not None and done.get((need[0], need[1], a.mb), tick) >= tick:
                continue
            if own is not None and done.get(own, tick) >= tick:
                continue
            ran.append((r, a))
        if not ran:
            stuck = {r: orders[r][pos[r]] for r in range(pp) if pos[r] < len(orders[r])}
            raise ValueError(f"pipeline schedule {schedule!r} with pp={pp}, virtual_stages={v}, microbatches={m} "
                             f"deadlocks at tick {tick}: waiting ranks {stuck}")
        for r, a in ran:
            done[(a.op, a.chunk, a.mb)] = tick
            rows[r].append((tick, a))
            pos[r] += 1
        tick += 1
    for r in range(pp):
        for t, a in rows[r]:
            need = _input_of(a, n_chunks)
            if need is None:
                continue
            src = need[1] % pp
            if src != r:
                transfers.append(Transfer(src=src, dst=r, tick=done[(need[0], need[1], a.mb)], action=a))
    transfers.sort(key=lambda t: (t.tick, t.src, t.dst))
    return Timetable(pp=pp, v=v, m=m, ticks=rows, transfers=transfers)


def bubble_fraction(pp: int, v: int, m: int) -> float:
    """The textbook bubble, idle time over ideal compute time: (p - 1) / (v * m)."""
    return (pp - 1) / (v * m)
