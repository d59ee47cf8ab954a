"""`generate()`'s decode steps replayed from CUDA graphs on a transformers model (inference/graphs.py).

What it overlaps: the host's launches of a decode step with the device's work (one replay instead of
hundreds of launches). `capture_decode_graphs(model)` wraps the model's forward: a decode step (one
token a row, no gradient, CUDA, a static KV cache: `generate(..., cache_implementation="static")`)
is replayed from a graph captured for its batch size; anything else (the prefill, a dynamic cache, a
CPU model, a step while a recorder or profiler runs, so that the timeline sees every collective) runs
the forward as it is. The attention mask `generate()` grows by one column a step is handed to the graph
padded with zeros to the cache's length: the columns past the current position are masked by
causality anyway, so the padded mask selects exactly what the grown one does.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..inference.graphs import StepGraphs
from ..runtime import recorder


def capture_decode_graphs(model: nn.Module) -> StepGraphs:
    """Replay `model`'s decode steps from CUDA graphs (see the module doc); returns the StepGraphs (its
    `replays` counts served steps, `refused` says why a signature runs eagerly). Works on a model from
    overlapkit.parallelize or a plain one. Sets `model.generation_config.disable_compile`: generate()
    compiles a static-cache forward on CUDA by itself otherwise."""
    original = model.forward
    graphs = StepGraphs(original)
    config = getattr(model, "generation_config", None)
    if config is not None:
        # generate() would otherwise torch.compile the forward by itself on CUDA with a static cache:
        # the graphs take that role, and a compiled call around them would trace the replay
        config.disable_compile = True
    model.forward = functools.partial(_maybe_replay, original, graphs)
    return graphs


def _cache(kwargs: dict):
    return kwargs.get("cache", kwargs.get("past_key_values"))


def _max_length(cache) -> int | None:
    shape = getattr(cache, "get_max_cache_shape", None)
    length = shape() if shape is not None else None
    return length if isinstance(length, int) and length > 0 else None


def _graphable(args: tuple, kwargs: dict) -> bool:
    ids = kwargs.get("input_ids")
    cache = _cache(kwargs)
    return (not args and ids is not None and ids.is_cuda and ids.dim() == 2 and ids.shape[1] == 1
            and not torch.is_grad_enabled() and getattr(cache, "is_compileable", False)
            and _max_length(cache) is not None and recorder.active() is None and not recorder.profiling())


def _maybe_replay(original, graphs: StepGraphs, *args, **kwargs):
    if not _graphable(args, kwargs):
        return original(*args, **kwargs)
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        padded = mask.new_zeros((mask.shape[0], _max_length(_cache(kwargs))))
        padded[:, :mask.shape[1]] = mask
        kwargs["attention_mask"] = padded
    return graphs(**kwargs)

