"""overlapkit: hide communication behind computation in PyTorch distributed training, and prove it.

Names load on first use (PEP 562), so `overlapkit plan` — pure arithmetic — answers without
paying for importing torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "ParallelGroups": ("overlapkit.runtime.groups", "ParallelGroups"),
    "ParallelSizes": ("overlapkit.runtime.groups", "ParallelSizes"),
    "init": ("overlapkit.runtime.groups", "init"),
    "resolve_group": ("overlapkit.runtime.groups", "resolve_group"),
    "RankMismatchError": ("overlapkit.runtime.agreement", "RankMismatchError"),
    "timeline": ("overlapkit.timeline", None),
    "parallelize": ("overlapkit.models.parallelize", "parallelize"),
    "pipeline": ("overlapkit.models.hf_pipeline", "pipeline"),
    "vocab_parallel_cross_entropy": ("overlapkit.tensor_parallel.vocab", "vocab_parallel_cross_entropy"),
    "optim_param_groups": ("overlapkit.optim", "optim_param_groups"),
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'overlapkit' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(module)
    return value if attr is None else getattr(value, attr)
