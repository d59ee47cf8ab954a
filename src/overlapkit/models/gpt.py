"""A tiny plain GPT (embedding, causal attention, MLP, layer norm) used by the demo and the tests.

Plain PyTorch, nothing parallel: `overlapkit.models.parallelize` swaps in the parallel layers
after the fact. Activations are [seq, batch, hidden] so that sequence parallelism splits dim 0.
The fused QKV weight is laid out head by head ([heads, 3, head_dim] rows), so that slicing its
rows over tensor-parallel ranks hands each rank whole heads with their q, k and v.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..vocabulary import positive_int


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the tiny GPT."""

    vocab_size: int = 64
    """Tokens in the vocabulary; the output head is split over TP ranks, so a multiple of tp."""
    seq_len: int = 16
    """Maximum sequence length (position embeddings); a multiple of tp under sequence parallelism."""
    hidden: int = 32
    """Model width."""
    num_heads: int = 4
    """Attention heads; a multiple of tp (each rank owns whole heads)."""
    ffn_hidden: int = 64
    """MLP inner width; a multiple of tp."""
    num_layers: int = 2
    """Transformer blocks."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "hidden", "num_heads", "ffn_hidden", "num_layers"):
            positive_int(getattr(self, name), f"GPTConfig.{name}")
        if self.hidden % self.num_heads:
            raise ValueError(f"GPTConfig.hidden={self.hidden} is not divisible by num_heads={self.num_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # [s, b, heads_here * 3 * head_dim]; heads_here shrinks under TP
        s, b = qkv.shape[0], qkv.shape[1]
        q, k, v = qkv.view(s, b, -1, 3, self.head_dim).unbind(3)  # each [s, b, h, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, h, s, d]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(o.permute(2, 0, 1, 3).reshape(s, b, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn_hidden)
        self.fc2 = nn.Linear(cfg.ffn_hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """idx [batch, seq] (token ids) -> logits [seq, batch, vocab]."""

    def __init__(self, cfg: GPTConfig, *, moe=None, moe_every: int = 1) -> None:
        """`moe`: a callable taking a block index and returning the module (e.g. an
        overlapkit.expert_parallel.MoE) that replaces that block's MLP, in every `moe_every`-th
        block (blocks moe_every-1, 2*moe_every-1, ...; 2 alternates dense and MoE as Switch does)."""
        super().__init__()
        positive_int(moe_every, "GPT moe_every")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.hidden)
        # Where the sequence enters the blocks; parallelize() makes it a scatter over TP ranks.
        self.enter_blocks: nn.Module = nn.Identity()
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        if moe is not None:
            for i, block in enumerate(self.blocks):
                if (i + 1) % moe_every == 0:
                    block.mlp = moe(i)
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, s = idx.shape
        if s > self.cfg.seq_len:
            raise ValueError(f"sequence length {s} exceeds GPTConfig.seq_len={self.cfg.seq_len}")
        pos = torch.arange(s, device=idx.device)
        x = (self.tok_emb(idx) + self.pos_emb(pos)).transpose(0, 1)  # [s, b, h]
        x = self.enter_blocks(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def aux_loss(self) -> torch.Tensor | float:
        """Sum of the last forward's auxiliary losses of the MoE layers (0.0 without any): add a
        small multiple (e.g. 0.01) to the language-model loss to keep the routers balanced."""
        losses = [m.aux_loss for m in self.modules() if isinstance(getattr(m, "aux_loss", None), torch.Tensor)]
        return sum(losses) if losses else 0.0


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; logits [s, b, V], targets [b, s].

    Logits split over the vocabulary (a DTensor sharded on its last dim, what the parallelized
    GPT returns) go to vocab_parallel_cross_entropy: the [tokens, V] logits are never gathered.
    """
    if hasattr(logits, "device_mesh"):
        from ..tensor_parallel.vocab import vocab_parallel_cross_entropy
        return vocab_parallel_cross_entropy(logits, targets.transpose(0, 1))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.transpose(0, 1).reshape(-1))
