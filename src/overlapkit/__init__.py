"""overlapkit: hide communication behind computation in PyTorch distributed training, and prove it."""

from . import timeline
from .groups import ParallelGroups, ParallelSizes, init

__version__ = "0.1.0"

__all__ = ["ParallelGroups", "ParallelSizes", "init", "timeline", "__version__"]
