"""One contiguous gradient buffer cut into buckets in backward order, so that each bucket's
reduction can overlap the backward of the layers that come before it.

Parameters' `.grad` are views into the buffer: backward accumulates straight into the memory
that the collective sends, with no copy. Buckets follow the reverse of registration order,
which is roughly the order in which backward produces gradients (the last layers first), so
the first bucket fills early and its reduction has the most backward left to hide behind.
The first bucket is small (PyTorch DDP's 1 MiB) so that communication starts as soon as
possible; the rest are large (25 MiB, or what `bucket_mb="auto"` measured fastest: bucket_auto.py)
so that each collective runs near full bandwidth.

A DTensor parameter (a TP layer's shard, a replicated norm) keeps its type: the buffer holds its
local tensor's gradient and `.grad` is a DTensor of the parameter's spec around that view, so an
optimizer, `clip_grad_norm_` and DCP see the DTensor while the collectives send plain memory.

Every bucket is padded to a multiple of `pad_to` elements (the data-parallel size times an
alignment), so that it splits into equal shards for a reduce-scatter / all-gather and every
shard starts aligned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from ..tensor_parallel.params import grad_as_param, is_dtensor, param_parts

MIB = 1024 * 1024


def local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor behind `t` (its local shard when `t` is a DTensor)."""
    return t._local_tensor if is_dtensor(t) else t


def assign_buckets(nbytes: Sequence[int], first_cap_bytes: float, cap_bytes: float) -> list[list[int]]:
    """Group items, given in backward order, into consecutive buckets.

    A bucket closes as soon as it holds at least its cap (the first bucket's cap is
    `first_cap_bytes`, the others' `cap_bytes`), so a bucket exceeds its cap by less than its
    last item, and an item is never split. Returns the item indices of each bucket.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, n in enumerate(nbytes):
        current.append(i)
        size += n
        if size >= (first_cap_bytes if not buckets else cap_bytes):
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


@dataclass
class Bucket:
    """A slice of the gradient buffer whose reduction is one collective."""

    index: int
    """Position in launch order: 0 holds the last layers' parameters (ready first in backward)."""
    offset: int
    """First element of the bucket in the buffer."""
    numel: int
    """Elements, padding included (a multiple of the buffer's pad_to)."""
    params: list[nn.Parameter] = field(default_factory=list)
    """Parameters in the bucket, in backward order."""
    names: list[str] = field(default_factory=list)
    """Their names, for error messages."""

    def shard(self, rank: int, world: int) -> tuple[int, int]:
        """Buffer range [start, end) of rank's equal shard of this bucket."""
        size = self.numel // world
        return self.offset + rank * size, self.offset + (rank + 1) * size


class GradBuffer:
    """The contiguous gradient buffer of a list of parameters and its buckets.

    `named_params` come in registration order (tied parameters once). All must share one
    dtype and device: a bucket is one collective on one tensor.
    """

    def __init__(self, named_params: Sequence[tuple[str, nn.Parameter]], *, bucket_mb: float,
                 first_bucket_mb: float, pad_to: int) -> None:
        if not named_params:
            raise ValueError("no parameter requires a gradient: there is nothing to reduce")
        kinds = {(p.dtype, p.device) for _, p in named_params}
        if len(kinds) > 1:
            found = ", ".join(f"{n}: {p.dtype} on {p.device}" for n, p in named_params)
            raise ValueError(f"all parameters must share one dtype and device for one gradient buffer; got {found}")
        if pad_to < 1:
            raise ValueError(f"pad_to must be >= 1, got {pad_to}")
        self.dtype, self.device = next(iter(kinds))
        self.pad_to = pad_to
        backward_order = list(reversed(named_params))
        item = torch.empty((), dtype=self.dtype).element_size()
        groups = assign_buckets([local(p).numel() * item for _, p in backward_order],
                                first_bucket_mb * MIB, bucket_mb * MIB)
        self.buckets: list[Bucket] = []
        self._where: dict[nn.Parameter, tuple[int, int, int]] = {}  # param -> (offset, numel, bucket)
        offset = 0
        for b, members in enumerate(groups):
            bucket = Bucket(index=b, offset=offset, numel=0)
            for i in members:
                name, p = backward_order[i]
                n = local(p).numel()
                self._where[p] = (offset + bucket.numel, n, b)
                bucket.params.append(p)
                bucket.names.append(name)
                bucket.numel += n
            bucket.numel = -(-bucket.numel // pad_to) * pad_to
            offset += bucket.numel
            self.buckets.append(bucket)
        self.fine: list[Bucket] = self.buckets
        """The buckets as cut; `regroup` makes each collective's bucket a run of consecutive ones."""
        self.data = torch.zeros(offset, dtype=self.dtype, device=self.device)
        self._views = {p: self.view(p, self.data) for _, p in named_params}
        for _, p in named_params:
            self.attach(p)

    def regroup(self, sizes: Sequence[int]) -> None:
        """Make `buckets` runs of `sizes[j]` consecutive fine buckets (in order; they sum to all of them).

        A run is one contiguous slice of the same buffer, so nothing moves: the gradients keep their
        views, and its size is a sum of padded sizes, still a multiple of pad_to.
        """
        if sum(sizes) != len(self.fine) or any(k < 1 for k in sizes):
            raise ValueError(f"a grouping of {len(self.fine)} fine buckets, got runs {list(sizes)}")
        self.buckets, start = [], 0
        for j, k in enumerate(sizes):
            run = self.fine[start:start + k]
            bucket = Bucket(index=j, offset=run[0].offset, numel=sum(b.numel for b in run),
                            params=[p for b in run for p in b.params], names=[n for b in run for n in b.names])
            for p in bucket.params:
                self._where[p] = (*self._where[p][:2], j)
            self.buckets.append(bucket)
            start += k

    @property
    def params(self) -> list[nn.Parameter]:
        """All parameters, in backward order."""
        return [p for b in self.buckets for p in b.params]

    def bucket_of(self, p: nn.Parameter) -> int:
        return self._where[p][2]

    def view(self, p: nn.Parameter, data: torch.Tensor | None = None) -> torch.Tensor:
        """p's slice of the buffer (its local gradient), or of `data`, a tensor laid out like the buffer."""
        if data is None:
            return self._views[p]
        offset, numel, _ = self._where[p]
        return data[offset:offset + numel].view_as(local(p))

    def bucket_data(self, b: int) -> torch.Tensor:
        bucket = self.buckets[b]
        return self.data[bucket.offset:bucket.offset + bucket.numel]

    def attach(self, p: nn.Parameter) -> None:
        """Make p.grad the buffer view again if something replaced it (zero_grad(set_to_none), an assignment).

        A replaced gradient is the whole current gradient, so it overwrites the view; no gradient
        at all (None) means zero.
        """
        view = self._views[p]
        g = None if p.grad is None else local(p.grad)
        if g is view or g is not None and g.data_ptr() == view.data_ptr() and g.shape == view.shape:
            return
        if g is None:
            view.zero_()
        else:
            view.copy_(g)
        p.grad = self._as_grad(p, view)

    def attach_missing(self) -> None:
        """Put the zeroed view back as the gradient of every parameter whose `.grad` is None.

        For the start of backward after an optimizer's `zero_grad()` (which sets them to None):
        autograd then accumulates straight into the buffer, where it would otherwise make a new
        tensor that the gradient hook copies in, parameter by parameter.
        """
        missing = [p for p in self._views if p.grad is None]
        if not missing:
            return
        if len(missing) == len(self._views):
            self.data.zero_()
        for p in missing:
            view = self._views[p]
            if len(missing) != len(self._views):
                view.zero_()
            p.grad = self._as_grad(p, view)

    @staticmethod
    def _as_grad(p: nn.Parameter, view: torch.Tensor) -> torch.Tensor:
        spec, loc = param_parts(p)
        return view if spec is None else grad_as_param(view, spec, loc)

    def zero_(self) -> None:
        """Zero every gradient in place, keeping the views (and putting back those replaced)."""
        self.data.zero_()
        for p, view in self._views.items():
            if p.grad is not view:  # a plain parameter's attached gradient is the view itself
                p.grad = self._as_grad(p, view)
