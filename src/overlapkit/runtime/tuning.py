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
    `agree_over`: further groups whose ranks must keep the same candidate as well (the times are
    all-reduced over each in turn, so the slowest rank of all of them judges): e.g. a data-parallel
    engine's sequence-parallel group, whose per-bucket sums pair across data-parallel groups.
    """

    def __init__(self, candidates: Sequence[Any], group, *, what: str, kind: str, rounds: int = 3,
                 warmup_rounds: int = 1, tie: float = 0.01, agree_over: Sequence = ()) -> None:
        if not candidates:
            raise ValueError(f"{what}: MeasuredChoice needs at least one candidate")
        if rounds < 1 or warmup_rounds < 0:
            raise ValueError(f"{what}: rounds={rounds} must be >= 1 and warmup_rounds={warmup_rounds} >= 0")
        self.candidates = list(candidates)
        self.group, self.what, self.kind, self.tie = group, what, kind, tie
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
        fwd, total = [[] for _ in range(n)], [[] for _ in range(n)]
        for k, f0, f1, b0, b1 in self._stamps[self._warm:]:
            if f1 is None:
                continue  # a call whose forward raised
            f = _ms(f0, f1)
            fwd[k].append(f)
            if b1 is not None:
                total[k].append(f + _ms(b0, b1))
        mine = [statistics.median(v) if v else -1.0 for v in fwd + total]
        vals = torch.tensor(mine, dtype=torch.float64, device=self._device)
        for g in [self.group, *self.agree_over]:
            if g is not None and dist.is_initialized() and comm.group_size(g) > 1:
                comm.all_reduce(vals, g, kind=self.kind, name=f"{self.what}.auto", op=dist.ReduceOp.MAX,
                                async_op=False)
        agreed = vals.tolist()
        with_bwd = all(v >= 0 for v in agreed[n:])
        score = agreed[n:] if with_bwd else agreed[:n]
        best = min(score)
        k = next(i for i, v in enumerate(score) if v <= best * (1 + self.tie))
        self.decided = self.candidates[k]
        self.measured = dict(zip(self.candidates, score))
        shown = ", ".join(f"{c}: {v:.3g} ms" for c, v in self.measured.items())
        self.reason = (f"measured {'forward+backward' if with_bwd else 'forward'} (median of "
                       f"{len(self._schedule) // n - self._warm // n} calls each, slowest rank): {shown}")
        self._stamps = []
