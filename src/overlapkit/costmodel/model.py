"""One decoder-only transformer as the cost model sees it: the widths whose GEMMs overlap hides behind.

`ModelConfig` holds what one layer computes (and, for a mixture of experts, how many experts it holds
and how many each token visits); `MODEL_PRESETS` the published configurations. Nothing here depends on
how the model is split: `parallel.ParallelConfig` says that.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import _validate as v

MAX_DIM = {"hidden": 1 << 20, "ffn_hidden": 1 << 22, "num_layers": 100_000, "num_heads": 1 << 16,
           "seq_len": 1 << 24, "vocab_size": 1 << 24, "num_experts": 1 << 16, "top_k": 1 << 16}
"""Largest accepted model sizes: beyond them a number is a typo, and the arithmetic would print nonsense."""


@dataclass(frozen=True)
class ModelConfig:
    """One decoder-only transformer (JSON keys are the field names)."""

    hidden: int
    """Model width h."""
    ffn_hidden: int
    """MLP width (per branch for gated MLPs)."""
    num_layers: int
    """Transformer layers."""
    num_heads: int
    """Query heads."""
    seq_len: int
    """Tokens per sequence."""
    vocab_size: int
    """Vocabulary size (the LM head GEMM's N)."""
    num_kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0 means num_heads."""
    head_dim: int = 0
    """Width of one head; 0 means hidden / num_heads."""
    gated_mlp: bool = True
    """SwiGLU (two up-projections, fused into one GEMM) as in Llama; False for GPT's GeLU MLP."""
    tied_embeddings: bool = False
    """Input embedding and LM head share weights (GPT-3) or not (Llama 3)."""
    num_experts: int = 1
    """Experts per MoE layer; 1 is a dense model."""
    top_k: int = 1
    """Experts each token is routed to (MoE only)."""
    name: str = "custom"
    """Label in reports."""

    def __post_init__(self) -> None:
        o = f"model({self.name})"
        for f in ("hidden", "ffn_hidden", "num_layers", "num_heads", "seq_len", "vocab_size",
                  "num_experts", "top_k"):
            v.positive_int(o, f, getattr(self, f))
            if getattr(self, f) > MAX_DIM[f]:
                raise v.ConfigError(f"{o}.{f}={getattr(self, f)}: must be <= {MAX_DIM[f]} (larger than any model trained)")
        for f in ("gated_mlp", "tied_embeddings"):
            v.boolean(o, f, getattr(self, f))
        for f in ("num_kv_heads", "head_dim"):
            x = getattr(self, f)
            if not isinstance(x, int) or isinstance(x, bool) or x < 0:
                raise v.ConfigError(f"{o}.{f}={x!r}: must be an integer >= 1 (or 0: the default)")
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim == 0:
            v.divides(o, "hidden", self.hidden, "num_heads", self.num_heads)
            object.__setattr__(self, "head_dim", self.hidden // self.num_heads)
        v.positive_int(o, "num_kv_heads", self.num_kv_heads)
        v.positive_int(o, "head_dim", self.head_dim)
        v.divides(o, "num_heads", self.num_heads, "num_kv_heads", self.num_kv_heads)
        if self.top_k > self.num_experts:
            raise v.ConfigError(f"{o}.top_k={self.top_k} exceeds num_experts={self.num_experts}")

    @property
    def layer_params(self) -> int:
        """Parameters of one layer (attention, MLP or experts, two norms)."""
        return self.dense_layer_params + self.expert_layer_params

    @property
    def expert_layer_params(self) -> int:
        """Parameters of one layer's experts (0 for a dense model): what expert parallelism divides."""
        if self.num_experts == 1:
            return 0
        return ((2 if self.gated_mlp else 1) + 1) * self.hidden * self.ffn_hidden * self.num_experts

    @property
    def dense_layer_params(self) -> int:
        """Parameters of one layer every rank of a TP group holds a shard of: attention, the (dense) MLP,
        the router and two norms."""
        h, d = self.hidden, self.head_dim
        attn = h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h
        mlp = ((2 if self.gated_mlp else 1) + 1) * h * self.ffn_hidden if self.num_experts == 1 else 0
        router = h * self.num_experts if self.num_experts > 1 else 0
        return attn + mlp + router + 2 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def params(self) -> int:
        """All parameters."""
        return self.num_layers * self.layer_params + self.embedding_params + self.hidden

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        return v.from_dict(cls, d, "model")


# Published configurations: Llama 3 (Meta, "The Llama 3 Herd of Models", 2024, Table 3, and the
# released config.json files); GPT-3 175B (Brown et al. 2020, Table 2.1: 96 layers, d=12288,
# 96 heads, context 2048; vocabulary of GPT-2's BPE, 50257).
MODEL_PRESETS = {
    "llama3-8b": ModelConfig(hidden=4096, ffn_hidden=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                             seq_len=8192, vocab_size=128256, name="llama3-8b"),
    "llama3-70b": ModelConfig(hidden=8192, ffn_hidden=28672, num_layers=80, num_heads=64, num_kv_heads=8,
                              seq_len=8192, vocab_size=128256, name="llama3-70b"),
    "llama3-405b": ModelConfig(hidden=16384, ffn_hidden=53248, num_layers=126, num_heads=128, num_kv_heads=8,
                               seq_len=8192, vocab_size=128256, name="llama3-405b"),
    "gpt3-175b": ModelConfig(hidden=12288, ffn_hidden=49152, num_layers=96, num_heads=96, seq_len=2048,
                             vocab_size=50257, gated_mlp=False, tied_embeddings=True, name="gpt3-175b"),
}
