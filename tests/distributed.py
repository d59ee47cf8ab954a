"""`@distributed(world_size=N)`: run a test body on N gloo ranks on CPU.

The decorated function runs in every rank with the default group initialized; its return
values come back as a list, rank by rank. A failure on any rank fails the test with that
rank's traceback. Process groups get a short timeout so that a bug can never hang CI.

Ranks fork from one server process per test session (see `overlapkit.launch.start_method`)
that has already imported what test ranks import: torch, the engines, transformers' model
families, pytest and hypothesis. That import is paid once instead of once a rank.
"""

from __future__ import annotations

import functools
import importlib
import multiprocessing.forkserver

import torch

from overlapkit.launch import spawn, start_method

HF_FAMILIES = ("llama", "qwen2", "mistral", "gemma", "gemma2", "qwen3", "phi3", "olmo", "olmo2", "gpt_neox", "cohere",
               "granite", "starcoder2", "phi")
"""The transformers families tests/models builds (its hf_families.FAMILIES; a missing one is skipped)."""

PRELOAD = ("numpy", "pytest", "hypothesis", "transformers", "overlapkit.runtime", "overlapkit.timeline",
           "overlapkit.tensor_parallel", "overlapkit.data_parallel", "overlapkit.pipeline_parallel",
           "overlapkit.expert_parallel", "overlapkit.context_parallel", "overlapkit.models", "overlapkit.optim",
           "overlapkit.demos", *(f"transformers.models.{f}.modeling_{f}" for f in HF_FAMILIES))
"""What test ranks import, imported once by the server they fork from (a module that fails to import is skipped)."""


def start_rank_server() -> None:
    """Start the rank server now, so its imports run while pytest collects (a no-op without forkserver)."""
    if start_method("gloo", PRELOAD) == "forkserver":
        multiprocessing.forkserver.ensure_running()


def distributed(world_size: int | None, timeout_s: float = 45.0, backend: str = "gloo"):
    """`world_size=None` means one rank per visible GPU (for backend="nccl")."""
    def wrap(fn):
        @functools.wraps(fn)
        def runner(*args, **kwargs):
            n = world_size if world_size is not None else torch.cuda.device_count()
            return spawn(_call, n, fn.__module__, fn.__qualname__, args, kwargs,
                         backend=backend, timeout_s=timeout_s, preload=PRELOAD)
        return runner
    return wrap


def _call(module: str, qualname: str, args, kwargs):
    # The module attribute is the runner; the test body is what it wraps.
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj.__wrapped__(*args, **kwargs)
