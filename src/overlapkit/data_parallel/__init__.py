"""Data parallelism with gradient reduction overlapped with backward, and a sharded optimizer
whose parameter gather overlaps the next forward."""

from .buckets import Bucket, GradBuffer, assign_buckets
from .ddp import DataParallel, DataParallelConfig, GradSync
from .zero import ShardedOptimizer

__all__ = ["Bucket", "GradBuffer", "assign_buckets", "DataParallel", "DataParallelConfig", "GradSync",
           "ShardedOptimizer"]
