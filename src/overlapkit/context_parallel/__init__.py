"""Context parallelism: ring attention whose key/value exchange hides behind the attention of the block in hand.

Each CP rank holds a slice of the sequence (`split`: zigzag for causal load balance); key/value
blocks travel around the ring (`ring`) while each block's attention (`kernels`) runs, and the
partial results merge exactly by log-sum-exp (`attention`); `batch` cuts a batch and names the
group the replicated parameters average over. `models.ring_attention` swaps the ring into a
model's attention (our GPT, transformers models).
"""

from .attention import AUTO_CANDIDATES, OVERLAPS, ContextParallelConfig, OverlapChoices, RingAttention, ring_attention
from .batch import replicas_group, shard_batch, shard_labels
from .kernels import KERNELS
from .split import LAYOUTS, chunks_of, positions, shard, unshard

__all__ = ["shard_batch", "shard_labels", "replicas_group", "ContextParallelConfig", "RingAttention", "ring_attention", "OVERLAPS", "AUTO_CANDIDATES", "OverlapChoices",
           "KERNELS", "LAYOUTS",
           "chunks_of", "positions", "shard", "unshard"]
