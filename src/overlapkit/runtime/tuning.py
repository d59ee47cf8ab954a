"""Measure once and keep: a setting the cost model cannot pick well is timed on its first calls, and the fastest is kept.

It overlaps nothing itself. An engine whose `auto` is such a setting (the MoE layer's chunk count,
ring attention's overlap) hands `MeasuredChoice` its candidates. The first calls run the candidates
in turn (one warm-up round, then `rounds` rounds, each in the next rotated order), timing the
engine's own forward and, when it runs, backward. Then every rank of the group takes the slowest
rank's median per candidate (one all-reduce of a few numbers, once), so all ranks keep the same
setting and never run different collectives, and the fastest is kept. From then on the engine reads
one attribute per call: no clock, no CUDA event, no synchronization, no collective.

On CPU the clock is the host's; on CUDA each region is bracketed by two events on the current stream
(nothing waits for them until the decision, which synchronizes once to read them).
"""

from __future__ import annotations

import contextlib
import statistics
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from . import comm
from .clock import elapsed_ms as _ms, stamp


def _stamp(device: torch.device):
    # The trial clock, by this name: tests replace it to show nothing is timed after a decision.
    return stamp(device.type == "cuda")


class Trial:
    """One call that runs candidate `choice` while the trials last; time its passes with `forward()` / `backward()`."""

    __slots__ = ("choice", "_owner", "_call")

    def __init__(self, owner: "MeasuredChoice", call: int, choice: Any) -> None:
        self.choice, self._owner, self._call = choice, owner, call

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        with self._owner._timed(self._call, 0):
            yield

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        with self._owner._timed(self._call, 1):
            yield


def timed(trial: Trial | None, phase: str):
    """`trial.forward()` or `trial.backward()` (phase "forward" / "backward"), or nothing when there is no trial."""
    return contextlib.nullcontext() if trial is None else getattr(trial, phase)()


class MeasuredChoice:
    """Candidates tried on the first calls, then the fastest kept (the same on every rank of `group`).

    `candidates` are in order of preference: among those within `tie` of the fastest the first wins
    (the one with less machinery, so noise never buys complexity). `kind` and `what` name the one
    all-reduce that agrees the times on the timeline. A single candidate is decided at once.

    paired=True judges by rounds instead of by medians (for candidates that may be near ties): each
    call's time is the slowest rank's (the all-reduce carries every call, not each rank's medians),
    and a candidate displaces the first only if it was faster than the first in at least three
    rounds in four and its median per-round ratio to the first is below 1 - tie; among those that
    do, the lowest median ratio wins. A gap smaller than the rounds' spread keeps the first.
    `agree_over`: further groups whose ranks must keep the same candidate as well (the times are
    all-reduced over each in turn, so the slowest rank of all of them judges): e.g. a data-parallel
    engine's sequence-parallel group, whose per-bucket sums pair across data-parallel groups.
    """

    def __init__(self, candidates: Sequence[Any], group, *, what: str, kind: str, rounds: int = 3,
                 warmup_rounds: int = 1, tie: float = 0.01, paired: bool = False,
                 agree_over: Sequence = ()) -> None:
        if not candidates:
            raise ValueError(f"{what}: MeasuredChoice needs at least one candidate")
        if rounds < 1 or warmup_rounds < 0:
            raise ValueError(f"{what}: rounds={rounds} must be >= 1 and warmup_rounds={warmup_rounds} >= 0")
        self.candidates = list(candidates)
        self.group, self.what, self.kind, self.tie, self.paired = group, what, kind, tie, paired
        self.agree_over = [g for g in agree_over if g is not None]
        n = len(self.candidates)
        self._schedule = [(r * n + k, (k + r) % n) for r in range(warmup_rounds + rounds) for k in range(n)]
        self._warm = warmup_rounds * n
        self._calls = 0
        self._stamps: list[list] = []  # per call: [candidate, fwd start, fwd end, bwd start, bwd end]
        self._device: torch.device | None = None
        self.decided: Any | None = self.candidates[0] if n == 1 else None
        """The kept candidate (None while the trials last)."""
        self.measured: dict[Any, float] | None = None
        """Per candidate, the agreed time it was judged by (ms, the slowest rank's median), after the decision."""
        self.reason = "one candidate: nothing to measure" if n == 1 else ""
        """Why `decided` is what it is, in words."""
        self.per_phase: dict[str, Any] | None = None
        """paired=True, calls timed in both phases: the candidate the same rule keeps from the forward
        times alone and from the backward times alone (for a setting with a part per phase)."""

    @property
    def trial_calls(self) -> int:
        """Calls the trials take (warm-up included); the call after the last one decides."""
        return len(self._schedule)

    def decide_now(self, choice: Any, reason: str) -> None:
        """Keep `choice` without measuring (the cost model knows); it must be the same on every rank."""
        self.decided, self.reason = choice, reason
        self._stamps = []

    def trial(self, device: torch.device | str) -> Trial | None:
        """The next call's trial, or None once decided (read `decided`); decides after the last trial.

        Collective over the group on the call that decides: every rank must make the same calls.
        """
        if self.decided is not None:
            return None
        self._device = torch.device(device)
        if self._calls >= len(self._schedule):
            self._decide()
            return None
        call, k = self._schedule[self._calls]
        self._calls += 1
        self._stamps.append([k, [], []])  # per phase, [start, end] of each pass
        return Trial(self, call, self.candidates[k])

    @contextlib.contextmanager
    def _timed(self, call: int, phase: int) -> Iterator[None]:
        if self.decided is not None or call >= len(self._stamps):
            yield  # a backward that outlived the trials: nothing left to time
            return
        span = [_stamp(self._device), None]  # a phase may run several passes in a call (they add up)
        self._stamps[call][1 + phase].append(span)
        yield
        span[1] = _stamp(self._device)

    def _decide(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)  # once: the trial events are read here
        n = len(self.candidates)
        timed = self._stamps[self._warm:]

        def ms(spans: list) -> float:  # -1: not run, or a pass that raised
            return sum(_ms(a, b) for a, b in spans) if spans and all(b is not None for _, b in spans) else -1.0
        calls = [[ms(f), ms(b)] for _k, f, b in timed]
        calls = [[f, b, f + b if f >= 0 and b >= 0 else -1.0] for f, b in calls]  # forward, backward, both
        if self.paired:  # every call's times, so that the slowest rank is taken call by call
            mine = [v for row in calls for v in row]
        else:
            mine = [statistics.median(v) if v else -1.0 for p in (0, 2) for c in range(n)
                    for v in [[r[p] for r, (k, *_) in zip(calls, timed) if k == c and r[p] >= 0]]]
        vals = torch.tensor(mine, dtype=torch.float64, device=self._device)
        for g in [self.group, *self.agree_over]:
            if g is not None and dist.is_initialized() and comm.group_size(g) > 1:
                comm.all_reduce(vals, g, kind=self.kind, name=f"{self.what}.auto", op=dist.ReduceOp.MAX,
                                async_op=False)
        agreed = vals.tolist()
        rounds = len(self._schedule) // n - self._warm // n
        if self.paired:
            rows = [agreed[3 * i:3 * i + 3] for i in range(len(calls))]
            with_bwd = all(r[2] >= 0 for r in rows if r[0] >= 0)
            k, self.measured, shown = self._by_rounds([r[2 if with_bwd else 0] for r in rows], rounds)
            what = (f"{'forward+backward' if with_bwd else 'each timed region'} in {rounds} rounds (slowest rank a "
                    f"call); {shown}")
            if with_bwd:
                self.per_phase = {p: self.candidates[self._by_rounds([r[i] for r in rows], rounds)[0]]
                                  for i, p in enumerate(("forward", "backward"))}
        else:
            with_bwd = all(v >= 0 for v in agreed[n:])
            score = agreed[n:] if with_bwd else agreed[:n]
            best = min(score)
            k = next(i for i, v in enumerate(score) if v <= best * (1 + self.tie))
            self.measured = dict(zip(self.candidates, score))
            what = f"{'forward+backward' if with_bwd else 'forward'} (median of {rounds} calls each, slowest rank)"
        self.decided = self.candidates[k]
        shown = ", ".join(f"{c}: {v:.3g} ms" for c, v in self.measured.items())
        self.reason = f"measured {what}: {shown}"
        self._stamps = []

    def _by_rounds(self, values: list[float], rounds: int) -> tuple[int, dict, str]:
        """paired=True: the index kept from the agreed per-call times (see the class docstring), each
        candidate's median ms, and the ratios in words."""
        n = len(self.candidates)
        grid = [[-1.0] * n for _ in range(rounds)]  # round -> candidate -> ms
        for i, (k, *_) in enumerate(self._stamps[self._warm:]):
            grid[i // n][k] = values[i]
        measured = {c: statistics.median([g[k] for g in grid if g[k] >= 0] or [-1.0])
                    for k, c in enumerate(self.candidates)}
        ratios = {k: sorted(g[k] / g[0] for g in grid if g[k] >= 0 and g[0] > 0) for k in range(1, n)}
        beats = {k: statistics.median(r) for k, r in ratios.items()
                 if r and statistics.median(r) < 1 - self.tie and 4 * sum(x < 1 for x in r) >= 3 * len(r)}
        k = min(beats, key=beats.get) if beats else 0
        shown = ", ".join(f"{self.candidates[j]} {statistics.median(r):.3f}" for j, r in ratios.items() if r)
        return k, measured, (f"median per-round ratio to {self.candidates[0]}: {shown}; "
                             + (f"{self.candidates[k]} faster in at least 3 rounds in 4" if k else
                                f"none faster by more than {self.tie:.0%} in at least 3 rounds in 4: "
                                f"{self.candidates[0]} kept") + "; median ms")
