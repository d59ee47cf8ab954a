"""`bucket_mb="auto"`: how many bytes one gradient collective carries, measured on the first steps and kept.

The gradient buffer is cut once into fine buckets (the first at `first_bucket_mb`, the rest at
FINE_MB). A candidate is a cap: consecutive fine buckets join one collective until it holds at least
the cap. Since the buffer is contiguous in backward order, a run of fine buckets is one wider slice
of the same memory: switching candidates moves no gradient and allocates nothing, it only changes
which slices the collectives send (and re-binds the gradient hooks to the new bucket indices).

Caps whose runs come out the same on this model are one candidate; at world size 1 nothing is
communicated and the first candidate is kept at once. Each synced step's forward and
backward (up to the last collective's wait) are timed by `overlapkit.runtime.tuning.MeasuredChoice`:
a warm-up round, then ROUNDS rounds of every candidate in rotated order; the synced forward after
the last trial agrees the slowest rank's time of every call (one all-reduce) and judges by rounds
(paired=True): a cap displaces the first (DDP's 25 MiB) only if it was faster in at least 3 rounds
of 4 and its median per-round ratio is below 0.99 — near ties keep the first (with a sequence_parallel_group, agreed over it too: each
bucket's TP sum pairs with the TP peers' buckets). From then on the hooks are those of a fixed grouping and the
sync holds no timer: no clock, no event, no extra collective.

A sharded optimizer owns each rank's shard of each bucket, so its layout needs the grouping when it
is built: auto then keeps the first candidate (DDP's 25 MiB) without measuring.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..runtime.tuning import MeasuredChoice
from .buckets import MIB, assign_buckets

AUTO = "auto"
FINE_MB = 1.0
"""Cap of the fine buckets, the grain every candidate is made of (PyTorch DDP's first bucket)."""
AUTO_CAPS_MB = (25.0, 4.0, 100.0, 1.0)
"""Candidate caps in order of preference: DDP's default first, so that noise never moves it."""
ROUNDS = 4
"""Timed rounds of every candidate (after one warm-up round): enough for "faster in 3 rounds of 4"."""


def runs_for_cap(fine_bytes: Sequence[int], cap_bytes: float) -> tuple[int, ...]:
    """How many consecutive fine buckets each collective takes at `cap_bytes`; the first stays alone.

    The first fine bucket is the small first bucket (communication starts early); after it, runs
    close as soon as they hold at least the cap.
    """
    groups = assign_buckets(fine_bytes, 0, cap_bytes)
    return tuple(len(g) for g in groups)


class BucketAuto:
    """The trials of `bucket_mb="auto"` on one GradSync; `choice` is its MeasuredChoice (decided, reason, measured)."""

    def __init__(self, sync) -> None:
        self.sync = sync
        item = sync.buffer.data.element_size()
        fine = [b.numel * item for b in sync.buffer.fine]
        self.runs: dict[float, tuple[int, ...]] = {}
        for cap in AUTO_CAPS_MB:
            runs = runs_for_cap(fine, cap * MIB)
            if runs not in self.runs.values():
                self.runs[cap] = runs
        # With sequence parallelism each bucket's TP sum pairs with the TP peers' (other DP groups):
        # they must keep the same grouping too.
        self.choice = MeasuredChoice(list(self.runs), sync.group, what="dp-bucket-mb", kind="dp_all_reduce",
                                     rounds=ROUNDS, warmup_rounds=1, paired=True, agree_over=[sync.sp_group])
        self._trial = None
        self._backward = None  # the open timing region of the synced backward in progress
        # Until the first trial (a backward whose forward ran under no_sync, as a zero-bubble
        # pipeline's last weight pass does, takes none), the preferred grouping.
        sync.group_buckets(self.runs[self.choice.candidates[0]])
        if sync.world == 1:
            self.choice.decide_now(self.choice.candidates[0], "world size 1: nothing is communicated")
        elif self.choice.decided is not None:
            self.choice.reason = f"every candidate cap groups this model's buckets alike ({len(fine)} fine buckets)"
        if self.choice.decided is not None:
            self._keep()

    @property
    def deciding(self) -> bool:
        return self.choice.decided is None

    def before_forward(self, device: torch.device) -> None:
        """At a synced training forward: the next trial's grouping, or (collective, once) the decision."""
        # A backward that raised left its region open: that call is not counted (MeasuredChoice skips it).
        self._backward = None
        trial = self.choice.trial(device)
        if trial is None:
            self._keep()
            return
        self._trial = trial
        self.sync.group_buckets(self.runs[trial.choice])

    def forward(self):
        """The forward's timing region of the trial in progress."""
        return self._trial.forward()

    def backward_begins(self) -> None:
        if self._trial is not None and self._backward is None:
            self._backward = self._trial.backward()
            self._backward.__enter__()

    def backward_ends(self) -> None:
        if self._backward is not None:
            self._backward.__exit__(None, None, None)
        self._backward = self._trial = None

    def keep_first(self, why: str) -> None:
        """Decide without measuring (a sharded optimizer's layout is fixed now)."""
        if self.deciding:
            self.choice.decide_now(self.choice.candidates[0], why)
            self._keep()

    def _keep(self) -> None:
        self._trial = self._backward = None
        self.sync.group_buckets(self.runs[self.choice.decided])
        self.sync.auto = None  # nothing of the trials stays on the sync's path
