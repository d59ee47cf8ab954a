"""Data parallelism with gradient reduction overlapped with backward, and a sharded optimizer
whose parameter gather overlaps the next forward, and ZeRO-3 (FSDP2 underneath) whose per-block
gathers are prefetched behind the compute of the blocks before them."""

from .buckets import Bucket, GradBuffer, assign_buckets
from .fsdp import FullyShardConfig, PrefetchPlan, fully_shard, prefetch_plan
from .fsdp_comm import LayerComm, layer_report
from .ddp import DataParallel, DataParallelConfig, GradSync
from .zero import ShardedOptimizer

__all__ = ["Bucket", "GradBuffer", "assign_buckets", "DataParallel", "DataParallelConfig", "GradSync",
           "ShardedOptimizer", "FullyShardConfig", "PrefetchPlan", "fully_shard", "prefetch_plan",
           "LayerComm", "layer_report"]
