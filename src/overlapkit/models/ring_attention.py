"""Ring attention swapped into our GPT: the K/V ring hides behind each layer's attention (transformers
models: hf_ring_attention.py).

After the fact, like `models.parallelize`: parameters and their names are untouched, only the
attention computation (and, for the GPT, which positions the local tokens get) changes. Each
rank feeds its slice of every sequence, cut by `shard_batch` (zigzag by default), and gets the
logits of those tokens. Parameters are replicated over CP ranks, so their gradients are
averaged over data × context parallel ranks (`replicas_group`), as Megatron does over dp-cp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..context_parallel.attention import ContextParallelConfig, RingAttention
from ..context_parallel.split import check_seq_len, positions
from ..runtime.comm import group_rank, group_size
from ..runtime.entry import guard_entry
from ..runtime.groups import resolve_group
from ..tensor_parallel.params import LocalShardParams


# -- our GPT --------------------------------------------------------------------------------

class SlicePositionEmbedding(nn.Embedding):
    """The GPT's position embedding for a rank's slice: local index i gets the embedding of its global position."""

    def __init__(self, emb: nn.Embedding, group, layout: str) -> None:
        super().__init__(emb.num_embeddings, emb.embedding_dim, device=emb.weight.device, dtype=emb.weight.dtype)
        self.weight = emb.weight  # the same Parameter: names, optimizer state and checkpoints are unchanged
        self.group, self.layout = group, layout

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        size = group_size(self.group)
        seq_len = pos.shape[-1] * size
        check_seq_len(seq_len, size, self.layout, what="GPT sequence length")
        where = positions(seq_len, group_rank(self.group), size, self.layout, device=pos.device)
        # Under tensor parallelism the weight is a Replicate() DTensor: computed on its local tensor.
        return F.embedding(where[pos], LocalShardParams.local(self.weight))


class RingGPTAttention(nn.Module):
    """The GPT's attention with the ring in place of scaled_dot_product_attention (same qkv, proj modules)."""

    def __init__(self, attn: nn.Module, ring: RingAttention) -> None:
        super().__init__()
        self.head_dim, self.qkv, self.proj, self.ring = attn.head_dim, attn.qkv, attn.proj, ring

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # [s_local, b, heads_here * 3 * head_dim]: whole heads per TP rank, as in the GPT
        s, b = qkv.shape[0], qkv.shape[1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in qkv.view(s, b, -1, 3, self.head_dim).unbind(3))
        o = self.ring(q.contiguous(), k.contiguous(), v.contiguous())
        return self.proj(o.permute(2, 0, 1, 3).reshape(s, b, -1))


def apply_to_gpt(model: nn.Module, mesh_or_group, config: ContextParallelConfig = ContextParallelConfig()) -> nn.Module:
    """Make the GPT context parallel in place: feed it `shard_batch(idx, group)[0]`; it returns those tokens' logits."""
    group = resolve_group(mesh_or_group, "cp")
    check_seq_len(model.cfg.seq_len, group_size(group), config.layout, what="GPTConfig.seq_len")
    model.pos_emb = SlicePositionEmbedding(model.pos_emb, group, config.layout)
    for i, block in enumerate(model.blocks):
        block.attn = RingGPTAttention(block.attn, RingAttention(group, config, causal=True, name=f"blocks.{i}.attn.cp"))
    # CP ranks hold different tokens of slices of one size: shapes compared every forward, not values.
    guard_entry(model, group, "context parallel GPT", same_values=False)
    return model
