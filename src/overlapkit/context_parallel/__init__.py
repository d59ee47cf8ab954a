"""Context parallelism: ring attention whose key/value exchange hides behind the attention of the block in hand.

Each CP rank holds a slice of the sequence (`split`: zigzag for causal load balance); key/value
blocks travel around the ring (`ring`) while each block's attention (`kernels`) runs, and the
partial results merge exactly by log-sum-exp (`attention`). `apply_to_gpt` and
`apply_to_hf_llama` swap the ring into a model's attention.
"""

from .attention import AUTO_CANDIDATES, OVERLAPS, ContextParallelConfig, OverlapChoices, RingAttention, ring_attention
from .kernels import KERNELS
from .split import LAYOUTS, chunks_of, positions, shard, unshard

__all__ = ["ContextParallelConfig", "RingAttention", "ring_attention", "OVERLAPS", "AUTO_CANDIDATES", "OverlapChoices",
           "KERNELS", "LAYOUTS",
           "chunks_of", "positions", "shard", "unshard"]
