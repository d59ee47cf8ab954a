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
import time
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from . import comm


def _stamp(device: torch.device):
    if device.type == "cuda":
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def _ms(a, b) -> float:
    if isinstance(a, float):
        return (b - a) * 1e3
    return a.elapsed_time(b)


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
    """

    def __init__(self, candidates: Sequence[Any], group, *, what: str, kind: str, rounds: int = 3,
                 warmup_rounds: int = 1, tie: float = 0.01, paired: bool = False) -> None:
        if not candidates:
            raise ValueError(f"{what}: MeasuredChoice needs at least one candidate")
        if rounds < 1 or warmup_rounds < 0:
            raise ValueError(f"{what}: rounds={rounds} must be >= 1 and warmup_rounds={warmup_rounds} >= 0")
        self.candidates = list(candidates)
        self.group, self.what, self.kind, self.tie, self.paired = group, what, kind, tie, paired
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
        self._stamps.append([k, None, None, None, None])
        return Trial(self, call, self.candidates[k])

    @contextlib.contextmanager
    def _timed(self, call: int, phase: int) -> Iterator[None]:
        if self.decided is not None or call >= len(self._stamps):
            yield  # a backward that outlived the trials: nothing left to time
            return
        row = self._stamps[call]
        row[1 + 2 * phase] = _stamp(self._device)
        yield
        row[2 + 2 * phase] = _stamp(self._device)

    def _decide(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)  # once: the trial events are read here
        n = len(self.candidates)
        calls = [[-1.0, -1.0] for _ in self._stamps[self._warm:]]  # per timed call: forward, forward+backward ms
        for row, (_k, f0, f1, b0, b1) in zip(calls, self._stamps[self._warm:]):
            if f1 is not None:  # else a call whose forward raised
                row[0] = _ms(f0, f1)
                row[1] = row[0] + _ms(b0, b1) if b1 is not None else -1.0
        if self.paired:  # every call's time, so that the slowest rank is taken call by call
            mine = [v for row in calls for v in row]
        else:
            per = [[[r[p] for r, (k, *_) in zip(calls, self._stamps[self._warm:]) if k == c and r[p] >= 0]
                    for c in range(n)] for p in (0, 1)]
            mine = [statistics.median(v) if v else -1.0 for p in (0, 1) for v in per[p]]
        vals = torch.tensor(mine, dtype=torch.float64, device=self._device)
        if self.group is not None and dist.is_initialized() and comm.group_size(self.group) > 1:
            comm.all_reduce(vals, self.group, kind=self.kind, name=f"{self.what}.auto", op=dist.ReduceOp.MAX,
                            async_op=False)
        agreed = vals.tolist()
        rounds = len(self._schedule) // n - self._warm // n
        if self.paired:
            k, what = self._by_rounds([agreed[2 * i:2 * i + 2] for i in range(len(calls))], rounds)
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

    def _by_rounds(self, calls: list[list[float]], rounds: int) -> tuple[int, str]:
        """paired=True: the candidate kept from the agreed per-call times (see the class docstring)."""
        n = len(self.candidates)
        with_bwd = all(row[1] >= 0 for row in calls if row[0] >= 0)
        grid = [[-1.0] * n for _ in range(rounds)]  # round -> candidate -> ms
        for i, (k, *_) in enumerate(self._stamps[self._warm:]):
            grid[i // n][k] = calls[i][1 if with_bwd else 0]
        self.measured = {c: statistics.median([g[k] for g in grid if g[k] >= 0] or [-1.0])
                         for k, c in enumerate(self.candidates)}
        ratios = {k: sorted(g[k] / g[0] for g in grid if g[k] >= 0 and g[0] > 0) for k in range(1, n)}
        beats = {k: statistics.median(r) for k, r in ratios.items()
                 if r and statistics.median(r) < 1 - self.tie and 4 * sum(x < 1 for x in r) >= 3 * len(r)}
        k = min(beats, key=beats.get) if beats else 0
        shown = ", ".join(f"{self.candidates[j]} {statistics.median(r):.3f}" for j, r in ratios.items() if r)
        return k, (f"{'forward+backward' if with_bwd else 'each timed region'} in {rounds} rounds (slowest rank "
                   f"a call); median per-round ratio to {self.candidates[0]}: {shown}; "
                   + (f"{self.candidates[k]} faster in at least 3 rounds in 4" if k else
                      f"none faster by more than {self.tie:.0%} in at least 3 rounds in 4: {self.candidates[0]} kept")
                   + "; median ms")
