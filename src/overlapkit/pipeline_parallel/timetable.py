"""The timetable a schedule's orders imply: when each rank runs each slot, and every transfer between
ranks — the order both ends issue their sends and receives in, so that a transfer can be posted
before the compute it hides under; and, with durations for F, B and W, what the schedule costs:
its bubble and the peak of the activations and weight-gradient inputs it keeps.

A unit-time simulation: at tick t a rank runs its next slot if every input was produced at an
earlier tick. Transfers are grouped by the tick that produced them; every rank issues its
transfers tick by tick, so the sends from a to b and the receives b posts from a come in the same
order on both (NCCL matches point-to-point in issue order), and a schedule whose simulation
stalls is refused before anything is sent.
"""

from __future__ import annotations

from dataclasses import dataclass

from .schedules import Action, Slot, check_schedule, placement, rank_of, rank_slots


@dataclass(frozen=True)
class Transfer:
    """One activation (forward) or gradient (backward) crossing from one rank to another."""

    src: int
    dst: int
    tick: int
    """The tick whose slot produced it: transfers are issued in tick order on both ends."""
    action: Action
    """The action that consumes it on `dst`."""

    @property
    def tag(self) -> int:
        """A gloo tag unique within a step, so that a receive can only ever match its own send."""
        a = self.action
        return ((a.chunk * 2 + (a.op == "B")) << 20) + a.mb


@dataclass(frozen=True)
class Timetable:
    """When every rank runs each of its slots, and every transfer between ranks."""

    schedule: str
    pp: int
    v: int
    m: int
    ticks: list[list[tuple[int, Slot]]]
    """Per rank: (tick, slot) in run order."""
    transfers: list[Transfer]
    """Every transfer, sorted by (tick, src, dst)."""

    @property
    def n_ticks(self) -> int:
        return 1 + max(t for row in self.ticks for t, _ in row)

    @property
    def style(self) -> str:
        return placement(self.schedule)

    def rank_of(self, chunk: int) -> int:
        return rank_of(chunk, self.pp, self.style)

    def sends(self, rank: int) -> dict[int, list[Transfer]]:
        """tick -> transfers `rank` sends after that tick's slot."""
        return _by_tick(t for t in self.transfers if t.src == rank)

    def recvs(self, rank: int) -> dict[int, list[Transfer]]:
        """tick (of production) -> transfers `rank` receives."""
        return _by_tick(t for t in self.transfers if t.dst == rank)


def _by_tick(transfers) -> dict[int, list[Transfer]]:
    out: dict[int, list[Transfer]] = {}
    for t in transfers:
        out.setdefault(t.tick, []).append(t)
    return out


def input_of(a: Action, n_chunks: int) -> tuple[str, int] | None:
    """(op, chunk) of the action that produces what `a` needs from another chunk, or None."""
    if a.op == "F":
        return ("F", a.chunk - 1) if a.chunk > 0 else None
    if a.op == "W":
        return None
    # The backward of the last chunk starts from the loss (its own forward); others need the next chunk's grad.
    return ("B", a.chunk + 1) if a.chunk < n_chunks - 1 else None


def _needs(a: Action, n_chunks: int) -> list[tuple[str, int, int]]:
    """Every (op, chunk, mb) that must have run before `a`: its input, and its own earlier parts."""
    need = input_of(a, n_chunks)
    out = [(need[0], need[1], a.mb)] if need is not None else []
    if a.op == "B":
        out.append(("F", a.chunk, a.mb))
    if a.op == "W":
        out.append(("B", a.chunk, a.mb))
    return out


def timetable(schedule: str, pp: int, v: int, m: int, costs: tuple[float, float, float] = (1.0, 1.0, 1.0), *,
              split_backward: bool = False) -> Timetable:
    """Simulate the schedule on unit-time ticks; raise ValueError if it can never finish.

    `costs` (a chunk's F, B, W durations) shape zbv's order; `split_backward` splits a classic
    schedule's backwards into B then W; see schedules.rank_slots."""
    check_schedule(schedule, pp, v, m)
    n_chunks = pp * v
    orders = [rank_slots(schedule, pp, v, m, r, costs, split_backward=split_backward) for r in range(pp)]
    done: dict[tuple[str, int, int], int] = {}  # (op, chunk, mb) -> tick it ran
    pos = [0] * pp
    rows: list[list[tuple[int, Slot]]] = [[] for _ in range(pp)]
    tick = 0
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        ran = []
        for r in range(pp):
            if pos[r] == len(orders[r]):
                continue
            slot = orders[r][pos[r]]
            inside = {(a.op, a.chunk, a.mb) for a in slot}  # a full backward's W needs the B beside it
            if all(k in inside or done.get(k, tick) < tick for a in slot for k in _needs(a, n_chunks)):
                ran.append((r, slot))
        if not ran:
            stuck = {r: orders[r][pos[r]] for r in range(pp) if pos[r] < len(orders[r])}
            raise ValueError(f"pipeline schedule {schedule!r} with pp={pp}, virtual_stages={v}, microbatches={m} "
                             f"deadlocks at tick {tick}: waiting ranks {stuck}")
        for r, slot in ran:
            for a in slot:
                done[(a.op, a.chunk, a.mb)] = tick
            rows[r].append((tick, slot))
            pos[r] += 1
        tick += 1
    style = placement(schedule)
    transfers = []
    for r in range(pp):
        for _, slot in rows[r]:
            for a in slot:
                need = input_of(a, n_chunks)
                if need is None:
                    continue
                src = rank_of(need[1], pp, style)
                if src != r:
                    transfers.append(Transfer(src=src, dst=r, tick=done[(need[0], need[1], a.mb)], action=a))
    transfers.sort(key=lambda t: (t.tick, t.src, t.dst))
    return Timetable(schedule=schedule, pp=pp, v=v, m=m, ticks=rows, transfers=transfers)


@dataclass(frozen=True)
class ScheduleCost:
    """What a schedule costs with given durations (any time unit), from `price`."""

    step: float
    """First slot's start to the last slot's end, over all ranks."""
    busy: list[float]
    """Per rank: time computing."""
    peak_alive: list[int]
    """Per rank: the most chunk-micro-batches held at once (forward run, weight gradient not yet)."""
    peak_kept_w: list[int]
    """Per rank: the most weight-gradient inputs kept at once (B run, W not yet)."""

    @property
    def bubble_fraction(self) -> float:
        """Mean over ranks of idle time over compute: the measured counterpart (waits / compute)."""
        return sum((self.step - b) / b for b in self.busy) / len(self.busy)


def price(table: Timetable, f: float, b: float, w: float | None = None, p2p: float = 0.0) -> ScheduleCost:
    """Run the timetable's orders with durations: a forward takes f, an input-gradient backward b, a
    weight-gradient backward w (for the non-split schedules, whose "B" is the whole backward, pass
    b = the whole backward and w = None). A slot takes the sum of its actions (an overlapped pair
    hides communication, not compute); a transfer between ranks adds `p2p` to its consumer's wait.
    Every rank runs its slots in order, each as soon as the rank is free and its inputs have arrived.
    """
    n_chunks = table.pp * table.v
    dur = {"F": f, "B": b, "W": w or 0.0}
    end: dict[tuple[str, int, int], float] = {}
    free = [0.0] * table.pp
    busy = [0.0] * table.pp
    for _, r, slot in sorted((t, r, s) for r, row in enumerate(table.ticks) for t, s in row):
        inside = {(a.op, a.chunk, a.mb) for a in slot}  # tick order: every input ran at an earlier tick
        start = free[r]
        for a in slot:
            for k in _needs(a, n_chunks):
                if k not in inside:
                    crosses = k[:2] != (a.op, a.chunk) and k[0] != "W" and table.rank_of(k[1]) != r
                    start = max(start, end[k] + (p2p if crosses else 0.0))
        length = sum(dur[a.op] for a in slot)
        for a in slot:
            end[(a.op, a.chunk, a.mb)] = start + length
        free[r] = start + length
        busy[r] += length
    peak_alive, peak_w = [0] * table.pp, [0] * table.pp
    for r, row in enumerate(table.ticks):
        alive = kept = 0
        for _, slot in row:
            full = {(a.chunk, a.mb) for a in slot if a.op == "W"}  # a B beside its own W: a full backward
            for a in slot:
                if a.op == "F":
                    alive += 1
                elif a.op == "B" and (w is None or (a.chunk, a.mb) in full):
                    alive -= 1
                elif a.op == "B":
                    kept += 1
                elif not any(x.op == "B" and x.chunk == a.chunk and x.mb == a.mb for x in slot):
                    alive, kept = alive - 1, kept - 1
                peak_alive[r], peak_w[r] = max(peak_alive[r], alive), max(peak_w[r], kept)
    return ScheduleCost(step=max(free), busy=busy, peak_alive=peak_alive, peak_kept_w=peak_w)


def bubble_fraction(pp: int, v: int, m: int) -> float:
    """The textbook bubble of (interleaved) 1F1B, idle time over ideal compute time: (p - 1) / (v * m)."""
    return (pp - 1) / (v * m)
