"""Data parallelism whose gradient reduction overlaps backward: each bucket's all-reduce (or
reduce-scatter, under a sharded optimizer) runs while the earlier layers' backward computes.

A post-accumulate-grad hook marks a parameter ready; when every parameter of the next bucket
in launch order is ready, its collective starts at once. A callback queued on the autograd
engine runs when backward ends: it launches what is left and waits for everything, so the
optimizer sees reduced gradients with no extra call. Only the last bucket is exposed.

Buckets launch strictly in order, on every rank. A parameter that got no gradient holds its
bucket (and the ones after it) back until the end of backward, where they launch anyway; so
every rank issues the same collectives in the same order whatever its graph did, and a tiny
all-reduce of per-parameter "unused" flags, issued after the last bucket, tells every rank
which parameters lacked a gradient anywhere. Without `find_unused` that is a RuntimeError,
raised on every rank, after the collectives complete: no rank is ever left inside one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .. import comm
from ..timeline.recorder import compute_span
from ..tensor_parallel.params import localize_parameters
from ..groups import resolve_group
from .agree import check_same_on_ranks, check_same_per_item, copy_from_first_rank, raise_if_any
from .buckets import GradBuffer, local

MAX_BUCKET_MB = float(2**20)
"""Largest bucket cap accepted (1 TiB): more than any device holds, and far from the int64 byte counts overflowing."""

SHARD_ALIGN = 16
"""Elements every shard is a multiple of, so that each shard (and each bucket) starts aligned."""

_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


@dataclass(frozen=True)
class DataParallelConfig:
    """How gradients are bucketed and reduced."""

    bucket_mb: float = 25.0
    """Cap of every bucket but the first, in MiB of gradients. Large enough that a collective
    runs near full bandwidth, small enough that several buckets hide behind backward
    (PyTorch DDP's default, 25)."""
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
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v <= MAX_BUCKET_MB):
                raise ValueError(f"DataParallelConfig.{name} must be a finite number of MiB > 0 and "
                                 f"<= {MAX_BUCKET_MB:.0f} (1 TiB), got {v!r}")
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
                "bucket bytes": int(config.bucket_mb * 2**20), "first bucket bytes": int(config.first_bucket_mb * 2**20),
            }, group, device, "the parameters and bucket sizes")
            check_same_per_item([n for n, _ in named_params],
                                [f"{tuple(p.shape)} {p.dtype}" for _, p in named_params], group, device,
                                "the parameters' shapes")
        # What the buffer was built for: a parameter re-typed or moved later no longer fits it.
        self.layout = [(n, p, p.dtype, p.device) for n, p in named_params]
        self.layout_key = self.layout_now()
        self.buffer = GradBuffer(named_params, bucket_mb=config.bucket_mb,
                                 first_bucket_mb=config.first_bucket_mb, pad_to=self.world * SHARD_ALIGN)
        self.params = self.buffer.params
        self.names = [n for b in self.buffer.buckets for n in b.names]
        # param -> (its index in backward order, its bucket): one lookup per gradient in the hook
        self.slot = {p: (i, self.buffer.bucket_of(p)) for i, p in enumerate(self.params)}
        # Per bucket, the parameters whose gradient covers only this rank's tokens under
        # sequence parallelism: summed over the TP group just before the bucket is reduced.
        self._sp_params = [[p for p in b.params if getattr(p, "sequence_parallel", False)]
                           if sequence_parallel_group is not None else [] for b in self.buffer.buckets]
        rd = config.grad_reduce_dtype
        self.reduce_dtype = rd if rd is not None else self.buffer.dtype
        # Staging in the reduce dtype, kept for the buffer's life so that no collective ever
        # sends memory the allocator could hand out again while it is in flight.
        self._staging = (torch.empty_like(self.buffer.data, dtype=rd)
                         if rd is not None and rd != self.buffer.dtype else None)
        self.shards: list[torch.Tensor] | None = None
        self.enabled = True  # False inside no_sync()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        for p in self.params:
            p._overlapkit_grad_sync = True
        self.reset()

    def layout_now(self) -> list:
        """(dtype, device index) of every parameter: cheap to compare at each forward."""
        return [(p.dtype, p.get_device()) for _, p, _, _ in self.layout]

    # -- mode ------------------------------------------------------------------------------
    def shard_gradients(self) -> list[torch.Tensor]:
        """Reduce-scatter instead of all-reduce: each rank keeps its shard of every bucket.

        Returns the per-bucket shard tensors (reduce dtype) that backward fills from now on.
        """
        if self.shards is None:
            self.shards = [torch.zeros(b.numel // self.world, dtype=self.reduce_dtype, device=self.buffer.device)
                           for b in self.buffer.buckets]
        return self.shards

    def reset(self) -> None:
        """Forget a backward that never finished (an error inside it)."""
        self._in_backward = False
        self._syncing = False
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
        _queue_callback(self._end_backward)
        self._span = compute_span("backward")
        self._span.__enter__()

    def _on_grad(self, p: nn.Parameter) -> None:
        self.begin_backward(self.enabled)
        if not self._syncing:
            return
        self.buffer.attach(p)
        i, b = self.slot[p]
        if self._ready[i]:
            return  # a second accumulation in one backward (reentrant checkpointing): already counted
        self._ready[i] = True
        self._missing[b] -= 1
        if self.config.overlap:
            while self._next < len(self._missing) and self._missing[self._next] == 0:
                self._launch(self._next)

    def _launch(self, b: int) -> None:
        assert b == self._next, "buckets launch in order on every rank"
        self._next += 1
        if self._sp_params[b]:
            self._sum_sequence_parallel(b)
        data = self.buffer.bucket_data(b)
        if self.group is None:
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
        if self.shards is None:
            h = comm.all_reduce(src, self.group, kind="dp_all_reduce", name=name)
        else:
            h = comm.reduce_scatter(self.shards[b], src, self.group, kind="dp_reduce_scatter", name=name)
        self._handles.append((b, h))

    def _sum_sequence_parallel(self, b: int) -> None:
        """Sum this bucket's sequence-parallel gradients over the TP group (one flat all-reduce).

        Done here, before the bucket's own reduction, because a sharded optimizer's
        reduce-scatter leaves no full gradient behind to fix up after backward.
        """
        comm.all_reduce_coalesced([local(p.grad) for p in self._sp_params[b]], self.sp_group, kind="tp_all_reduce",
                                  name=f"sequence_parallel_grads.bucket{b}")

    def _end_backward(self) -> None:
        span, self._span = self._span, None
        if span is not None:
            span.__exit__(None, None, None)
        self._in_backward = False
        if not self._syncing:
            return
        self._syncing = False
        unready = [i for i, ready in enumerate(self._ready) if not ready]
        for i in unready:
            self.buffer.attach(self.params[i])  # no gradient this backward: contributes what it holds
        while self._next < len(self._missing):
            self._launch(self._next)
        flags = None
        if self.world > 1 and not self.config.find_unused:
            flags = torch.zeros(len(self.params), dtype=torch.float32)
            flags[unready] = 1.0
            flags = flags.to(self.buffer.device)
            flag_handle = comm.all_reduce(flags, self.group, kind="dp_all_reduce", name="unused-check")
        for b, h in self._handles:
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
            counts = [int(c) for c in flags.tolist()]
        else:
            counts = [0] * len(self.params)
            if not self.config.find_unused:
                for i in unready:
                    counts[i] = 1
        missing = [f"{self.names[i]} (on {c} of {self.world} ranks)" for i, c in enumerate(counts) if c]
        if missing:
            raise RuntimeError(
                "these parameters got no gradient in this backward, so their buckets could not be "
                f"reduced during it: {', '.join(missing)}. Pass find_unused=True to reduce zeros for "
                "them, or set requires_grad=False on parameters that are never used.")


def _strip_module_prefix(_module, state_dict, prefix, _local_metadata):
    for key in [k for k in state_dict if k.startswith(prefix + "module.")]:
        state_dict[prefix + key[len(prefix) + len("module."):]] = state_dict.pop(key)


def _add_module_prefix(module, state_dict, prefix, *_):
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + "module.")]:
        state_dict[prefix + "module." + key[len(prefix):]] = state_dict.pop(key)


class DataParallel(nn.Module):
    """Wraps `module` so that its gradients are averaged over the data-parallel `group` during backward.

    Parameters and buffers start as group rank 0's (like PyTorch DDP). Parameters' `.grad`
    are views into one buffer: keep them (zero with `zero_grad`; an optimizer's
    `zero_grad(set_to_none=True)` also works, at the cost of a copy per parameter).
    `overlap` also takes the engine-wide names "none" (False) and "bulk" (True).
    `sequence_parallel_group` (the TP group of a sequence-parallel model): the gradients of
    parameters marked `sequence_parallel` are summed over it in backward, bucket by bucket,
    before the data-parallel reduction — required with ShardedOptimizer, whose reduce-scatter
    consumes the gradients; then do not call allreduce_sequence_parallel_grads.
    """

    def __init__(self, module: nn.Module, group, *, bucket_mb: float = 25.0, first_bucket_mb: float = 1.0,
                 overlap: bool | str = True, grad_reduce_dtype: torch.dtype | None = None,
                 find_unused: bool = False, sequence_parallel_group=None) -> None:
        super().__init__()
        if isinstance(overlap, str):
            if overlap not in ("none", "bulk"):
                raise ValueError(f"DataParallel overlap={overlap!r}: expected True/False, 'none' or 'bulk'")
            overlap = overlap == "bulk"
        self.config = DataParallelConfig(bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb, overlap=overlap,
                                         grad_reduce_dtype=grad_reduce_dtype, find_unused=find_unused)
        self.module = module
        # None is the default group, as everywhere in torch.distributed (no group only without it).
        self.group = group = resolve_group(group, "dp")
        # DTensor parameters (TP shards, replicated norms) stay DTensors, so the optimizer's
        # states, clip_grad_norm_ and DCP see their placements; the buffers hold their local
        # tensors (buckets.py).
        experts = [n for n, p in module.named_parameters() if getattr(p, "expert_parallel", False)]
        if experts and comm.group_size(group) > 1:
            # Each EP rank holds other experts: averaging (and the rank-0 copy below) would mix
            # different experts' weights into every rank's, with no error.
            raise ValueError(
                f"DataParallel: {len(experts)} parameter(s) are expert-parallel (e.g. {experts[0]}): each rank "
                "holds different experts, so averaging them over the data-parallel group would mix them; use "
                "overlapkit.expert_parallel.average_data_parallel_grads for a model with MoE layers")
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.sync = GradSync(named, group, self.config, sequence_parallel_group)
        # No .grad before the first forward, as with torch's DDP: torch's get_state_dict takes
        # existing gradients for "this optimizer has stepped" and gives a fresh optimizer an empty
        # template, so set_state_dict would restore no optimizer state at all, silently. The
        # buffer views are attached (zeroed) when the first forward runs.
        for p in self.sync.params:
            p.grad = None
        self._grads_attached = False
        # With a sequence_parallel_group the TP sum of sequence-parallel gradients happens in
        # backward; allreduce_sequence_parallel_grads refuses to do it a second time.
        self.sums_sequence_parallel_grads = sequence_parallel_group is not None
        with torch.no_grad():
            copy_from_first_rank([local(t) for t in (*module.parameters(), *module.buffers())], group)
        # state_dict() without the "module." prefix: a DataParallel's checkpoint (DCP, torch.save)
        # is the wrapped model's, loadable into it unwrapped (a plain HF model) and back.
        self._register_state_dict_hook(_strip_module_prefix)
        self._register_load_state_dict_pre_hook(_add_module_prefix, with_module=True)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The wrapped module's parameters under the names `state_dict()` gives (no "module." prefix),
        so that torch's get_optimizer_state_dict keys the optimizer state as the model state."""
        return self.module.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.module.named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def _fqn_modifiers(self) -> dict[str, str]:
        # torch.distributed.checkpoint.state_dict's hook for wrappers whose state_dict() renames
        # keys: each top-level name of the wrapped module lives under `self.module`, so
        # get_state_dict / set_state_dict use the same unprefixed names state_dict() gives.
        m = self.module
        return {name: "module" for name in (*m._modules, *m._parameters, *m._buffers)}

    def localize_for_flat_parameters(self) -> None:
        """Make the parameters plain local tensors and rebuild the gradient buffer on them.

        For engines that turn parameters into views of one flat buffer (ShardedOptimizer);
        `state_dict()` still gives DTensors for the TP layers.
        """
        if not any(hasattr(p, "device_mesh") for p in self.module.parameters()):
            return  # plain already: the buffer fits
        for h in self.sync._hooks:
            h.remove()
        for p in self.sync.params:
            p._overlapkit_grad_sync = False  # this sync is replaced, not doubled
        localize_parameters(self.module)
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        self.sync = GradSync(named, self.group, self.config, self.sync.sp_group)

    def forward(self, *args, **kwargs):
        if not self.sync._in_backward:
            self.check_layout()
            self.sync.reset()
        if not self._grads_attached:
            self.sync.buffer.zero_()
            self._grads_attached = True
        with compute_span("forward"):
            out = self.module(*args, **kwargs)
        if torch.is_grad_enabled():
            sync = self.sync.enabled
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    # The first output gradient starts backward: queue its callback there, on
                    # the outermost graph task, and time backward from its very first op.
                    t.register_hook(lambda _g, sync=sync: self.sync.begin_backward(sync))
        return out

    def check_layout(self) -> None:
        """Raise if a parameter was re-typed or moved since wrapping (its gradient would miss the buffer).

        Runs at every forward: one dtype and device comparison per parameter.
        """
        if self.sync.layout_now() == self.sync.layout_key:
            return
        for name, p, dtype, device in self.sync.layout:
            if p.dtype != dtype or p.device != device:
                raise ValueError(
                    f"DataParallel: parameter {name} is now {p.dtype} on {p.device}, but the gradient buffer was "
                    f"built for {dtype} on {device} (a .to()/.double()/.half() after wrapping); its gradient "
                    "would no longer be reduced: build DataParallel after moving and casting the module")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next backward outside reduces the accumulated sum."""
        before = self.sync.enabled
        self.sync.enabled = False
        try:
            yield
        finally:
            self.sync.enabled = before

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffer in place; the views stay (set_to_none is ignored on purpose)."""
        self.sync.buffer.zero_()
