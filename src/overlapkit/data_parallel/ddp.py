"""Data parallelism whose gradient reduction overlaps backward: each bucket's all-reduce (or
reduce-scatter, under a sharded optimizer) runs while the earlier layers' backward computes
(the reduction itself is grad_sync.py's GradSync).

Parameters and buffers start as group rank 0's; the model is watched for changes after
wrapping (watch.py), which every rank learns of at the end of the next backward.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ..runtime import comm
from ..runtime.agreement import report_problem
from ..runtime.deprecation import deprecated
from ..runtime.recorder import compute_span
from ..tensor_parallel.params import localize_parameters
from ..runtime.groups import resolve_group
from ..vocabulary import OVERLAP_MEANING
from .agree import copy_from_first_rank
from .buckets import local
from .expert_grads import ExpertGrads, expert_params
from .progress import Progress
from .grad_sync import MAX_BUCKET_MB, SHARD_ALIGN, DataParallelConfig, GradSync
from .watch import ParamWatch

WATCH_ADVICE = ("the gradient buffer holds the parameters the model had then, in their dtype and device and "
                "with their requires_grad, and it alone is averaged over the ranks (a parameter it lacks would "
                "drift apart across them): build DataParallel after adding, freezing, moving and casting "
                "parameters")

__all__ = ["DataParallel", "DataParallelConfig", "GradSync", "MAX_BUCKET_MB", "SHARD_ALIGN"]

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
    `overlap`: "bulk" (buckets all-reduced during backward) or "none" (after it); True and False are
    the earlier spelling (a DeprecationWarning once).
    `sequence_parallel_group` (the TP group of a sequence-parallel model): the gradients of
    parameters marked `sequence_parallel` are summed over it in backward, bucket by bucket,
    before the data-parallel reduction — required with ShardedOptimizer, whose reduce-scatter
    consumes the gradients; then do not call allreduce_sequence_parallel_grads.
    `bucket_mb="auto"` (the default) times a few bucket caps on the first synced steps and keeps
    the fastest, the same on every rank (`bucket_choice` says which and why; bucket_auto.py).
    """

    def __init__(self, module: nn.Module, group, *, bucket_mb: float | str = "auto", first_bucket_mb: float = 1.0,
                 overlap: str = "bulk", grad_reduce_dtype: torch.dtype | None = None,
                 find_unused: bool = False, sequence_parallel_group=None) -> None:
        super().__init__()
        if isinstance(overlap, bool):
            deprecated("DataParallel(overlap=True | False)", 'DataParallel(overlap="bulk" | "none")')
        elif overlap in OVERLAP_MEANING["dp"]:
            overlap = overlap == "bulk"
        else:
            raise ValueError(f"DataParallel overlap={overlap!r}: expected 'none' or 'bulk'")
        self.config = DataParallelConfig(bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb, overlap=overlap,
                                         grad_reduce_dtype=grad_reduce_dtype, find_unused=find_unused)
        self.module = module
        # None is the default group, as everywhere in torch.distributed (no group only without it).
        self.group = group = resolve_group(group, "dp")
        # DTensor parameters (TP shards, replicated norms) stay DTensors, so the optimizer's
        # states, clip_grad_norm_ and DCP see their placements; the buffers hold their local
        # tensors (buckets.py).
        # Each EP rank holds other experts: averaging them (or copying rank 0's) over dp would mix
        # different experts into every rank's, with no error. They are reduced over their copies only.
        self.experts = ExpertGrads(expert_params(module) if comm.group_size(group) > 1 else [], group)
        self.sync = GradSync(self._dense_named(), group, self.config, sequence_parallel_group)
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
            own = {id(p) for p in self.experts.params}
            copy_from_first_rank([local(t) for t in (*module.parameters(), *module.buffers()) if id(t) not in own],
                                 group)
        self.experts.copy_from_first()
        # state_dict() without the "module." prefix: a DataParallel's checkpoint (DCP, torch.save)
        # is the wrapped model's, loadable into it unwrapped (a plain HF model) and back.
        self._register_state_dict_hook(_strip_module_prefix)
        self._register_load_state_dict_pre_hook(_add_module_prefix, with_module=True)
        self._watch_module()

    def _dense_named(self) -> list:
        own = {id(p) for p in self.experts.params}
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad and id(p) not in own]

    @property
    def bucket_choice(self):
        """With bucket_mb="auto": its MeasuredChoice (`decided`: the cap kept, in MiB; None while timing)."""
        return self.sync.bucket_choice

    def _watch_module(self) -> None:
        self.watch = ParamWatch(self.module, "DataParallel", WATCH_ADVICE)
        self._reported: str | None = None
        old = getattr(self, "progress", None)
        self.progress = Progress(self.sync.params, self.group, "DataParallel")
        """Backward passes and optimizer steps, compared across the ranks at every training forward."""
        if old is not None:
            self.progress.backwards, self.progress.steps = old.backwards, old.steps
        self.sync.progress = self.progress

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
        if self.experts.params:  # their copies are found from their EP mesh, which plain tensors lose
            raise ValueError("ShardedOptimizer: this DataParallel holds expert-parallel parameters, which it does not "
                             "shard yet; use a plain optimizer (DataParallel reduces each expert over its copies)")
        for h in self.sync._hooks:
            h.remove()
        for p in self.sync.params:
            p._overlapkit_grad_sync = False  # this sync is replaced, not doubled
        localize_parameters(self.module)
        self.sync = GradSync(self._dense_named(), self.group, self.config, self.sync.sp_group)
        self._watch_module()  # the parameters are new objects

    def forward(self, *args, **kwargs):
        timing = pending = None
        if not self.sync._in_backward:
            self._check_model()
            if self.sync.enabled:  # under no_sync() the ranks may run different numbers of micro-batches
                # Completed after the forward, which issues no data-parallel collective: its compute runs while a
                # late peer catches up (ShardedOptimizer's parameter gathers are still landing then). While
                # bucket_mb="auto" decides, its agreement is a collective of this group: the check completes first.
                pending = self.progress.before_forward(self.training, defer=self.sync.auto is None)
            self.sync.reset()
            auto = self.sync.auto
            if auto is not None and torch.is_grad_enabled() and self.sync.enabled:
                # bucket_mb="auto": this step's candidate grouping, or (on every rank at once) the decision.
                auto.before_forward(self.sync.buffer.device)
                timing = auto.forward() if self.sync.auto is not None else None
        if not self._grads_attached and self.sync.poison is None:
            self.sync.buffer.zero_()
            self._grads_attached = True
        with compute_span("forward"), timing if timing is not None else contextlib.nullcontext():
            out = self.module(*args, **kwargs)
        if pending is not None:
            pending()  # before backward's first bucket: a rank that skipped a step is named, not paired
        if torch.is_grad_enabled():
            sync = self.sync.enabled
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    # The first output gradient starts backward: queue its callback there, on
                    # the outermost graph task, and time backward from its very first op.
                    t.register_hook(lambda _g, sync=sync: self._begin_backward(sync))
        return out

    def _begin_backward(self, sync: bool) -> None:
        self.sync.begin_backward(sync)
        self.experts.begin_backward(sync and self.sync.enabled)

    def _check_model(self) -> None:
        # This rank's model changed since wrapping: the next backward still sends what the buffer
        # holds (so every rank's collectives pair) and then raises on every rank, naming it.
        problem = self.watch.problem()
        self.sync.poison = problem
        if problem is not None and problem != self._reported:
            # Said on the store before anything else can go wrong here (this forward may fail on
            # the changed model), so that a peer left waiting in a collective names it.
            report_problem(self.group, "DataParallel", problem)
            self._reported = problem

    def check_layout(self) -> None:
        """Raise ValueError if this rank's model changed since wrapping (a parameter added, removed,
        replaced, frozen or unfrozen, re-typed or moved): its gradient would miss the buffer.

        The forward checks this itself, and the next backward then raises on every rank; this is
        the same check on this rank alone, for a caller that wants to know before running a step.
        """
        problem = self.watch.problem()
        if problem is not None:
            raise ValueError(problem)

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
        """Zero the gradient buffer in place; the views stay (set_to_none is ignored on purpose). Expert
        gradients, outside the buffer, are set to None."""
        self.sync.buffer.zero_()
        self.experts.zero_grad()
