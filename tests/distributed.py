"""`@distributed(world_size=N)`: run a test body on N gloo ranks on CPU.

The decorated function runs in every rank with the default group initialized; its return
values come back as a list, rank by rank. A failure on any rank fails the test with that
rank's traceback. Process groups get a short timeout so that a bug can never hang CI.
"""

from __future__ import annotations

import functools
import importlib

import torch

from overlapkit.launch import spawn


def distributed(world_size: int | None, timeout_s: float = 45.0, backend: str = "gloo"):
    """`world_size=None` means one rank per visible GPU (for backend="nccl")."""
    def wrap(fn):
        @functools.wraps(fn)
        def runner(*args, **kwargs):
            n = world_size if world_size is not None else torch.cuda.device_count()
            return spawn(_call, n, fn.__module__, fn.__qualname__, args, kwargs,
                         backend=backend, timeout_s=timeout_s)
        return runner
    return wrap


def _call(module: str, qualname: str, args, kwargs):
    # The module attribute is the runner; the test body is what it wraps.
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj.__wrapped__(*args, **kwargs)
