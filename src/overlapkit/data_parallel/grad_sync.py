"""The gradient reduction of data parallelism, overlapped with backward: each bucket's all-reduce (or
reduce-scatter, under a sharded optimizer) runs while the earlier layers' backward computes.

A post-accumulate-grad hook marks a parameter ready; when every parameter of the next bucket
in launch order is ready, its collective starts at once. A callback queued on the autograd
engine runs when backward ends: it launches what is left and waits for everything, so the
optimizer sees reduced gradients with no extra call. Only the last bucket is exposed.

Host cost: the hook is the only Python that runs per parameter, so it does as little as it can
(its parameter's index and bucket are bound into it; one identity check tells that `.grad` is
still the buffer's view; the launch loop runs only when a bucket fills). Gradients an optimizer's
`zero_grad()` set to None get their zeroed views back when backward starts, so autograd
accumulates into the buffer itself instead of the hook copying each one in. At world size 1 the
average is the gradient itself: no collective is issued at all.

Buckets launch strictly in order, on every rank. A parameter that got no gradient holds its
bucket (and the ones after it) back until the end of backward, where they launch anyway; so
every rank issues the same collectives in the same order whatever its graph did, and a tiny
all-reduce of per-parameter "unused" flags, issued after the last bucket, tells every rank
which parameters lacked a gradient anywhere. Without `find_unused` that is a RuntimeError,
raised on every rank, after the collectives complete: no rank is ever left inside one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..runtime import comm
from ..runtime.agreement import RankMismatchError, exchange, raise_explained
from ..runtime.recorder import compute_span
from ..vocabulary import MAX_BUCKET_MB, check_bucket_mb
from .agree import check_same_on_ranks, check_same_per_item, raise_if_any
from . import bucket_auto
from .bucket_auto import AUTO, BucketAuto
from .buckets import GradBuffer

SHARD_ALIGN = 16
"""Elements every shard is a multiple of, so that each shard (and each bucket) starts aligned."""

_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


@dataclass(frozen=True)
class DataParallelConfig:
    """How gradients are bucketed and reduced."""

    bucket_mb: float | str = AUTO
    """Cap of every bucket but the first, in MiB of gradients. Large enough that a collective
    runs near full bandwidth, small enough that several buckets hide behind backward
    (PyTorch DDP's default, 25). "auto": a few caps are timed on the first synced steps and the
    fastest kept, the same on every rank (bucket_auto.py)."""
    first_bucket_mb: float = 1.0
    """Cap of the first bucket (the last layers' gradients). Small so that communication
    starts early in backward (PyTorch DDP's 1 MiB)."""
    overlap: bool = True
    """Launch each bucket's reduction as soon as it is full, during backward. False launches
    them all after backward: the sequential reference for timing."""
    grad_reduce_dtype: torch.dtype | None = None
    """Dtype the reduction runs in; None keeps the gradients' dtype. bfloat16 halves the bytes
    of fp32 gradients; float32 keeps the sum of bf16 gradients exact."""
    find_unused: bool = False
    """Reduce zeros for parameters that got no gradient, instead of raising. Off by default:
    an unused parameter is usually a bug, and knowing beats silently zero gradients."""

    def __post_init__(self) -> None:
        for name in ("bucket_mb", "first_bucket_mb"):
            check_bucket_mb(getattr(self, name), f"DataParallelConfig.{name}", auto=name == "bucket_mb")
        for name in ("overlap", "find_unused"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"DataParallelConfig.{name} must be True or False, got {getattr(self, name)!r}")
        d = self.grad_reduce_dtype
        if d is not None and not (isinstance(d, torch.dtype) and d.is_floating_point):
            raise ValueError(f"DataParallelConfig.grad_reduce_dtype must be None or a floating torch.dtype, got {d!r}")



class GradSync:
    """Reduces the gradients of `named_params` over `group` while backward runs.

    `group=None` means a world of one without torch.distributed: nothing is communicated
    (DataParallel turns the user's None into the default group first, as torch.distributed does).
    A parameter is reduced by one GradSync only: its hooks stay on the parameter for good.
    """

    def __init__(self, named_params: Sequence[tuple[str, nn.Parameter]], group,
                 config: DataParallelConfig, sequence_parallel_group=None) -> None:
        self.group, self.config = group, config
        self.sp_group = sequence_parallel_group
        self.world = comm.group_size(group)
        self.rank = comm.group_rank(group)
        if named_params:
            device = named_params[0][1].device
            taken = [n for n, p in named_params if getattr(p, "_overlapkit_grad_sync", False)]
            raise_if_any(f"parameters {taken[:4]}{' ...' if len(taken) > 4 else ''} are already reduced by a "
                         "DataParallel or ShardedOptimizer (its gradient hooks stay on them, so a second one would "
                         "reduce them twice): wrap a module once" if taken else None, group, device)
            # Ranks that bucket differently would pair unrelated collectives: refuse before any.
            check_same_on_ranks({
                "parameters": len(named_params), "elements": sum(p.numel() for _, p in named_params),
                "bucket_mb (bytes, 0: auto)": 0 if config.bucket_mb == AUTO else int(config.bucket_mb * 2**20),
                "first bucket bytes": int(config.first_bucket_mb * 2**20),
            }, group, device, "the parameters and bucket sizes")
            check_same_per_item([n for n, _ in named_params],
                                [f"{tuple(p.shape)} {p.dtype}" for _, p in named_params], group, device,
                                "the parameters' shapes")
        # auto cuts fine buckets once; its candidates are runs of them (bucket_auto.py).
        cap = bucket_auto.FINE_MB if config.bucket_mb == AUTO else config.bucket_mb
        self.buffer = GradBuffer(named_params, bucket_mb=cap, first_bucket_mb=config.first_bucket_mb,
                                 pad_to=self.world * SHARD_ALIGN)
        self.named = list(named_params)
        """(name, parameter) in registration order (a plain ShardedOptimizer's checkpoint keys follow it)."""
        self.params = self.buffer.params
        self.names = [n for b in self.buffer.buckets for n in b.names]
        rd = config.grad_reduce_dtype
        self.reduce_dtype = rd if rd is not None else self.buffer.dtype
        # Staging in the reduce dtype, kept for the buffer's life so that no collective ever
        # sends memory the allocator could hand out again while it is in flight.
        self._staging = (torch.empty_like(self.buffer.data, dtype=rd)
                         if rd is not None and rd != self.buffer.dtype else None)
        self.shards: list[torch.Tensor] | None = None
        self.enabled = True  # False inside no_sync()
        # Why this rank's model no longer fits the buffer (set by the engine's forward), or None:
        # backward then sends what the buffer holds, so the other ranks' collectives still pair,
        # and every rank raises at its end.
        self.poison: str | None = None
        self.progress = None
        """The engine's Progress (data_parallel/progress.py): told of every reduced backward."""
        self._hooks: list = []
        self._bind_buckets()
        for p in self.params:
            p._overlapkit_grad_sync = True
        self.reset()
        self.auto: BucketAuto | None = None
        """auto's trials while they last (None once decided, and for a fixed bucket_mb)."""
        self.bucket_choice = None
        """With bucket_mb="auto": its MeasuredChoice (`decided` cap in MiB, `reason`, `measured`)."""
        if config.bucket_mb == AUTO:
            auto = BucketAuto(self)  # decides at once where there is nothing to measure
            self.bucket_choice = auto.choice
            self.auto = auto if auto.deciding else None

    def _bind_buckets(self) -> None:
        """Bind each parameter's hook to its bucket (again after a regrouping)."""
        for h in self._hooks:
            h.remove()
        # param -> (its index in backward order, its bucket); the hooks have theirs bound in
        self.slot = {p: (i, self.buffer.bucket_of(p)) for i, p in enumerate(self.params)}
        # Per bucket, the parameters whose gradient covers only this rank's tokens under
        # sequence parallelism: summed over the TP group just before the bucket is reduced.
        self._sp_params = [[p for p in b.params if getattr(p, "sequence_parallel", False)]
                           if self.sp_group is not None else [] for b in self.buffer.buckets]
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_hook(i, b))
                       for p, (i, b) in self.slot.items()]

    def group_buckets(self, runs) -> None:
        """One collective per run of `runs[j]` consecutive fine buckets (between backwards; auto's trials)."""
        if self._in_backward:
            raise RuntimeError("DataParallel: the buckets cannot be regrouped inside a backward")
        if [b.numel for b in self.buffer.buckets] == self._run_sizes(runs):
            return  # already so (the fine buckets' sizes are > 0: equal sums in order are equal runs)
        if self.shards is not None:
            raise RuntimeError("DataParallel: a sharded optimizer's shards follow the buckets; they cannot change")
        self.buffer.regroup(runs)
        self._bind_buckets()
        self.reset()

    def _run_sizes(self, runs) -> list[int]:
        fine, out, start = self.buffer.fine, [], 0
        for k in runs:
            out.append(sum(b.numel for b in fine[start:start + k]))
            start += k
        return out

    # -- mode ------------------------------------------------------------------------------
    def shard_gradients(self) -> list[torch.Tensor]:
        """Reduce-scatter instead of all-reduce: each rank keeps its shard of every bucket.

        Returns the per-bucket shard tensors (reduce dtype) that backward fills from now on.
        """
        if self.auto is not None:
            self.auto.keep_first("a sharded optimizer shards each bucket, so its layout takes the grouping when it "
                                 "is built: the first candidate, unmeasured")
        if self.shards is None:
            self.shards = [torch.zeros(b.numel // self.world, dtype=self.reduce_dtype, device=self.buffer.device)
                           for b in self.buffer.buckets]
        return self.shards

    def reset(self) -> None:
        """Forget a backward that never finished (an error inside it)."""
        self._in_backward = False
        self._syncing = False
        self._collecting = False  # syncing, and this rank's model still fits the buffer
        self._span = None
        self._ready = [False] * len(self.params)
        self._missing = [len(b.params) for b in self.buffer.buckets]
        self._next = 0
        self._handles: list[tuple[int, comm.Handle]] = []

    # -- backward ----------------------------------------------------------------------------
    def begin_backward(self, sync: bool) -> None:
        """Called by the first hook of a backward: queue the end-of-backward callback."""
        if self._in_backward:
            return
        self.reset()
        self._in_backward = True
        self._syncing = sync and self.enabled
        self._collecting = self._syncing and self.poison is None
        if self.poison is None:  # (a changed model's parameters may no longer take the buffer's views)
            self.buffer.attach_missing()
        _queue_callback(self._end_backward)
        self._span = compute_span("backward")
        self._span.__enter__()
        if self.auto is not None and self._collecting:
            self.auto.backward_begins()

    def _grad_hook(self, i: int, b: int):
        """Parameter i's post-accumulate-grad hook (i in backward order, in bucket b)."""
        view = self.buffer.view(self.params[i])
        attach = self.buffer.attach
        overlap = self.config.overlap

        def on_grad(p: nn.Parameter) -> None:
            if not self._in_backward:
                self.begin_backward(self.enabled)
            if not self._collecting:
                return
            if p.grad is not view:  # replaced (set to None, assigned) or a DTensor around the view
                attach(p)
            ready = self._ready
            if ready[i]:
                return  # a second accumulation in one backward (reentrant checkpointing): already counted
            ready[i] = True
            missing = self._missing
            missing[b] -= 1
            if overlap and b == self._next and not missing[b]:
                while self._next < len(missing) and not missing[self._next]:
                    self._launch(self._next)
        return on_grad

    def _launch(self, b: int) -> None:
        assert b == self._next, "buckets launch in order on every rank"
        self._next += 1
        if self._sp_params[b]:
            self._sum_sequence_parallel(b)
        data = self.buffer.bucket_data(b)
        if self.group is None or (self.world == 1 and self._staging is None):
            # Nothing to average over: the gradient is its own mean (and, sharded, its own shard).
            if self.shards is not None:
                self.shards[b].copy_(data)
            return
        src = data
        if self._staging is not None:
            src = self._staging[data.storage_offset():data.storage_offset() + data.numel()]
            src.copy_(data)
        if self.world > 1:
            src.mul_(1.0 / self.world)  # average; scaling before the sum keeps low precision in range
        name = f"bucket{b}"
        if self.world == 1:  # only the reduce dtype's rounding, as every world size has it
            h = None
            if self.shards is not None:
                self.shards[b].copy_(src)
        elif self.shards is None:
            h = comm.all_reduce(src, self.group, kind="dp_all_reduce", name=name)
        else:
            h = comm.reduce_scatter(self.shards[b], src, self.group, kind="dp_reduce_scatter", name=name)
        self._handles.append((b, h))

    def _sum_sequence_parallel(self, b: int) -> None:
        """Sum this bucket's sequence-parallel gradients over the TP group (one flat all-reduce).

        Done here, before the bucket's own reduction, because a sharded optimizer's
        reduce-scatter leaves no full gradient behind to fix up after backward.
        """
        # The buffer's views (what .grad is once attached): under `poison`, .grad may be another
        # dtype, and the TP peers' sum must still pair with one of the buffer's size and dtype.
        comm.all_reduce_coalesced([self.buffer.view(p) for p in self._sp_params[b]], self.sp_group,
                                  kind="tp_all_reduce", name=f"sequence_parallel_grads.bucket{b}")

    def _end_backward(self) -> None:
        span, self._span = self._span, None
        if span is not None:
            span.__exit__(None, None, None)
        self._in_backward = False
        if not self._syncing:
            return
        self._syncing = False
        poison = self.poison
        unready = [i for i, ready in enumerate(self._ready) if not ready]
        if poison is None:
            for i in unready:
                self.buffer.attach(self.params[i])  # no gradient this backward: contributes what it holds
        while self._next < len(self._missing):
            self._launch(self._next)
        flags = None
        if self.world > 1:
            # One flag per parameter (no gradient here) and a last one: this rank's model changed.
            flags = torch.zeros(len(self.params) + 1, dtype=torch.float32)
            flags[unready] = 1.0
            flags[-1] = float(poison is not None)
            flags = flags.to(self.buffer.device)
            flag_handle = comm.all_reduce(flags, self.group, kind="dp_all_reduce", name="unused-check")
        b = None
        try:
            for b, h in self._handles:
                if h is not None:
                    h.wait()
                if self.shards is not None:
                    # .grad on this rank's shard: the true average (elsewhere: this rank's unreduced part).
                    lo, hi = self.buffer.buckets[b].shard(self.rank, self.world)
                    self.buffer.data[lo:hi].copy_(self.shards[b])
                elif self._staging is not None:
                    data = self.buffer.bucket_data(b)
                    data.copy_(self._staging[data.storage_offset():data.storage_offset() + data.numel()])
            self._handles = []
            if flags is not None:
                flag_handle.wait()
            if self.auto is not None:
                self.auto.backward_ends()
        except Exception as e:  # noqa: BLE001 - a peer that broke step may have said why
            raise_explained(self.group, "DataParallel", e,
                            "the flags after backward" if b is None else f"the reduction of bucket {b}")
        if flags is not None:
            counts = [int(c) for c in flags.tolist()]
            changed = counts.pop()
        else:
            counts, changed = [0] * len(self.params), int(poison is not None)
            for i in unready:
                counts[i] = 1
        if self.progress is not None:
            self.progress.backwards += 1
        if changed:
            self._raise_changed(poison, changed)
        if self.config.find_unused:
            return
        missing = [f"{self.names[i]} (on {c} of {self.world} ranks)" for i, c in enumerate(counts) if c]
        if missing:
            raise RuntimeError(
                "these parameters got no gradient in this backward, so their buckets could not be "
                f"reduced during it: {', '.join(missing)}. Pass find_unused=True to reduce zeros for "
                "them, or set requires_grad=False on parameters that are never used.")

    def _raise_changed(self, poison: str | None, changed: int) -> None:
        """Raise on every rank, after the collectives, naming each rank whose model changed and how.

        The texts travel through the job's store, once, only when some rank's model changed.
        """
        if self.world == 1:
            raise ValueError(poison)
        texts = [t["poison"] for t in exchange(self.group, "DataParallel", {"poison": poison})]
        ranks = dist.get_process_group_ranks(self.group)
        if all(t == texts[0] for t in texts):
            raise ValueError(texts[0])  # the same change on every rank: its own words
        told = "; ".join(f"rank {r}: {t.removeprefix('DataParallel: ')}" for r, t in zip(ranks, texts) if t is not None)
        same = [r for r, t in zip(ranks, texts) if t is None]
        raise RankMismatchError(f"DataParallel: the model changed after wrapping on {changed} of {self.world} ranks "
                                f"(ranks {same} kept theirs), so the ranks no longer train the same model: {told}")
