"""Where a model's sequence-parallel region stands in the forward in hand: split over the TP ranks, or not.

Nothing here overlaps anything. Sequence parallelism needs the sequence to split evenly over
the TP ranks; a decode step of `generate()` has one token. Rather than a user flag, the
region's entry (`ScatterSequence`) decides once per forward: it splits when it can, and when
it cannot — under no_grad, where no gradient would have to be summed over ranks that computed
the same tokens — it lets the whole sequence through and marks the region off, so that every
layer of the region computes as a plain tensor-parallel one for that forward (the column
layers take a replicated input, the row layers all-reduce). With gradients on, a sequence that
does not split is an error, as before.

One `SequenceRegion` per parallelized model (overlapkit.parallelize attaches it to every module
that reads it), not per process: two models never share one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class SequenceRegion:
    """The state of one model's sequence-parallel region, set at its entry each forward."""

    active: bool = True
    """Whether this forward's sequence is split over the TP ranks."""
    gather_logits: bool = False
    """Whether the output head hands out whole-vocabulary plain logits (set while `generate()` runs)."""
    decode: bool = False
    """Whether this forward runs the inference layout (set by overlapkit.models.prepare_decode's hook):
    no sequence split, each layer one plain GEMM on its shard, the row layers marked `fused_reduce`
    leaving their all-reduce to the decoder layer's fused all-reduce + residual add + norm."""


ATTR = "sequence_region"
"""The attribute of a module that holds its model's region (None or absent: always split)."""


def region_of(module) -> SequenceRegion | None:
    return getattr(module, ATTR, None)


def split_here(module) -> bool:
    """Whether the module's sequence is split in this forward."""
    region = region_of(module)
    return region is None or region.active


def decoding(module) -> bool:
    """Whether the module runs the inference layout in this forward (SequenceRegion.decode)."""
    region = region_of(module)
    return region is not None and region.decode and not torch.is_grad_enabled()


def _whole_logits_when_inferring(region: SequenceRegion, _module, args, kwargs):
    # No loss asked for and no gradient to keep: the caller reads logits as a plain model's
    # (generate(), evaluation by hand), so the output head hands them out whole.
    region.gather_logits = not torch.is_grad_enabled() and kwargs.get("labels") is None


def attach_region(model: nn.Module) -> SequenceRegion:
    """Give every module of `model` one shared region; inference without labels gets whole logits.

    The hook is a partial over the region (not a closure), so that `copy.deepcopy(model)` gets a
    region of its own, shared by the copy's modules and its hook alike.
    """
    region = SequenceRegion()
    for module in model.modules():
        setattr(module, ATTR, region)
    model.register_forward_pre_hook(functools.partial(_whole_logits_when_inferring, region), with_kwargs=True)
    return region
