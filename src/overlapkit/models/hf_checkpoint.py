"""A parallelized transformers model's `save_pretrained`: the HF checkpoint a plain model loads, bit-equal.

Nothing here overlaps anything. After `parallelize` every parameter is a DTensor (shards of the
TP layers, replicated norms); transformers' `save_pretrained` reads storages directly and fails
on them. `full_state_dict` gathers each shard into the whole tensor (a collective over the TP
group: every rank calls it), keeping tied parameters one tensor; the model's
`save_pretrained` is wrapped so that it saves that, written by global rank 0 only, every rank
returning once the files are there. Loading goes the other way without a wrapper: a
parallelized model's `load_state_dict` takes full plain tensors (an HF checkpoint, a plain
model's state dict) and keeps this rank's shard of each.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with every DTensor gathered whole (collective over its mesh); ties kept."""
    done: dict[int, torch.Tensor] = {}
    out = {}
    for key, value in model.state_dict().items():
        if id(value) not in done:
            done[id(value)] = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[key] = done[id(value)]
    return out


def _save_pretrained(original, model: nn.Module, save_directory, *args, state_dict=None, is_main_process=None,
                     **kwargs):
    if state_dict is None:
        state_dict = full_state_dict(model)
    ranked = dist.is_available() and dist.is_initialized()
    if is_main_process is None:
        is_main_process = not ranked or dist.get_rank() == 0
    result = original(save_directory, *args, state_dict=state_dict, is_main_process=is_main_process, **kwargs)
    if ranked:
        dist.barrier()  # no rank reads the directory before rank 0 has written it
    return result


def wrap_save_pretrained(model: nn.Module) -> None:
    """Make `model.save_pretrained(dir)` write the full checkpoint (collective: call it on every rank)."""
    original = getattr(model, "save_pretrained", None)
    if original is None or isinstance(original, functools.partial):
        return
    model.save_pretrained = functools.partial(_save_pretrained, original, model)
