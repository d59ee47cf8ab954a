"""A transformer and how it is split over GPUs: the GEMMs and the messages overlap works with.

`ModelConfig` says what one layer computes; `ParallelConfig` says how TP, SP, PP, DP, EP and
ZeRO split it and which overlap each engine uses. `validate` refuses sizes that don't divide
with one line naming the field, before anything is predicted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from . import _validate as v

MODES = ("none", "bulk", "pipelined", "auto")
"""Overlap settings, with the same meaning in every engine."""
RECOMPUTE = ("none", "selective", "full")
TRANSPORTS = ("p2p", "symm_mem")
"""Pipelined TP transports: NCCL send/recv (takes SMs) or copy-engine pulls (takes none)."""


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
        h, d = self.hidden, self.head_dim
        attn = h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h
        mlp = ((2 if self.gated_mlp else 1) + 1) * h * self.ffn_hidden * self.num_experts
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


def load_model(spec: "str | Path | ModelConfig") -> ModelConfig:
    """A preset name, a JSON file with ModelConfig's keys, or a ModelConfig."""
    if isinstance(spec, ModelConfig):
        return spec
    if str(spec) in MODEL_PRESETS:
        return MODEL_PRESETS[str(spec)]
    path = Path(spec)
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise v.ConfigError(f"model={str(spec)!r}: no such file")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise v.ConfigError(f"model={str(spec)!r}: not valid JSON ({e.msg} at line {e.lineno})") from None
        return ModelConfig.from_dict({"name": path.stem, **data})
    raise v.ConfigError(f"model={str(spec)!r}: unknown preset; known: {', '.join(MODEL_PRESETS)} "
                        f"(or a path to a JSON file)")


@dataclass(frozen=True)
class Overlap:
    """The overlap setting of each engine (none, bulk, pipelined or auto)."""

    tp: str = "none"
    """TP/SP: bulk hides backward dgrad collectives behind wgrad; pipelined also chunks the
    forward (and backward) all-gather/reduce-scatter into the GEMMs."""
    dp: str = "none"
    """DP gradient buckets reduced during backward (any setting but none)."""
    zero: str = "none"
    """ZeRO parameter gathers prefetched behind earlier layers' compute."""
    pp: str = "none"
    """Pipeline send/recv beside the other micro-batch's compute in 1F1B."""
    ep: str = "none"
    """MoE dispatch/combine chunked against expert GEMMs (pipelined or auto)."""

    def __post_init__(self) -> None:
        for f in ("tp", "dp", "zero", "pp", "ep"):
            v.one_of("overlap", f, getattr(self, f), MODES)

    @classmethod
    def all(cls, mode: str) -> "Overlap":
        return cls(mode, mode, mode, mode, mode)


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over GPUs, and what overlaps."""

    tp: int = 1
    """Tensor-parallel size (adjacent ranks, inside one node)."""
    pp: int = 1
    """Pipeline stages."""
    vpp: int = 1
    """Virtual stages (model chunks) per pipeline rank: interleaved 1F1B."""
    dp: int = 1
    """Data-parallel replicas."""
    ep: int = 1
    """Expert-parallel size, carved out of the DP ranks (MoE only)."""
    sp: bool = True
    """Sequence parallelism: TP's all-reduces become all-gather + reduce-scatter, which can overlap."""
    micro_batch: int = 1
    """Sequences per micro-batch."""
    global_batch: int = 0
    """Sequences per optimizer step over all replicas; 0 means micro_batch * dp (one micro-batch)."""
    recompute: str = "none"
    """Activation recomputation: none, selective (attention core) or full (whole layer)."""
    zero: int = 0
    """ZeRO stage: 1/2 shard optimizer state/gradients (reduce-scatter + parameter all-gather),
    3 also shards parameters (gathered per layer, per micro-batch)."""
    overlap: Overlap = field(default_factory=Overlap)
    """Overlap per engine."""
    tp_transport: str = "p2p"
    """How pipelined TP chunks move: p2p (NCCL send/recv) or symm_mem (copy engines)."""
    dtype: str = "bf16"
    """Data type of GEMMs and activations (bf16 or fp8)."""
    grad_bytes: int = 2
    """Bytes per gradient element in the DP reduction (2: bf16, 4: fp32 reduction)."""
    bucket_mib: float = 25.0
    """DP gradient bucket size, MiB (PyTorch DDP's default)."""

    def __post_init__(self) -> None:
        o = "parallel"
        for f in ("tp", "pp", "vpp", "dp", "ep", "micro_batch"):
            v.positive_int(o, f, getattr(self, f))
        if self.global_batch == 0:
            object.__setattr__(self, "global_batch", self.micro_batch * self.dp)
        v.positive_int(o, "global_batch", self.global_batch)
        v.divides(o, "global_batch", self.global_batch, "micro_batch*dp", self.micro_batch * self.dp)
        v.one_of(o, "recompute", self.recompute, RECOMPUTE)
        v.one_of(o, "zero", self.zero, (0, 1, 2, 3))
        v.one_of(o, "tp_transport", self.tp_transport, TRANSPORTS)
        v.one_of(o, "dtype", self.dtype, ("bf16", "fp8"))
        v.one_of(o, "grad_bytes", self.grad_bytes, (2, 4))
        v.positive(o, "bucket_mib", self.bucket_mib)
        if self.vpp > 1 and self.pp == 1:
            raise v.ConfigError(f"parallel.vpp={self.vpp} needs pp > 1 (virtual stages interleave a pipeline)")
        v.divides(o, "dp", self.dp, "ep", self.ep)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step on each pipeline."""
        return self.global_batch // (self.micro_batch * self.dp)


def validate(model: ModelConfig, par: ParallelConfig, gpus_per_node: int, hardware_name: str = "",
             gpus: int | None = None) -> None:
    """Refuse a split that does not divide or does not fit the hardware; one line per error."""
    o = "parallel"
    v.divides("model", "num_heads", model.num_heads, "tp", par.tp)
    if model.num_kv_heads % par.tp and par.tp % model.num_kv_heads:
        raise v.ConfigError(f"model.num_kv_heads={model.num_kv_heads} and tp={par.tp}: one must divide the other")
    v.divides("model", "ffn_hidden", model.ffn_hidden, "tp", par.tp)
    v.divides("model", "num_layers", model.num_layers, "pp*vpp", par.pp * par.vpp)
    if par.sp:
        v.divides("model", "seq_len", model.seq_len, "tp (sequence parallelism)", par.tp)
    if par.vpp > 1 and par.micro_batches % par.pp:
        raise v.ConfigError(f"{o}.global_batch={par.global_batch} gives {par.micro_batches} micro-batches: "
                            f"interleaved 1F1B (vpp={par.vpp}) needs a multiple of pp={par.pp}")
    if par.ep > 1 and model.num_experts == 1:
        raise v.ConfigError(f"{o}.ep={par.ep} needs a mixture-of-experts model (num_experts > 1)")
    if par.ep > 1:
        v.divides("model", "num_experts", model.num_experts, "ep", par.ep)
    where = f" of {hardware_name}" if hardware_name else ""
    if par.tp > gpus_per_node:
        raise v.ConfigError(f"{o}.tp={par.tp} exceeds gpus_per_node={gpus_per_node}{where}: "
                            f"tensor parallelism must stay inside one NVLink node")
    if par.world > gpus_per_node and par.world % gpus_per_node:
        raise v.ConfigError(f"world size tp*pp*dp={par.world} does not fill whole nodes of {gpus_per_node} GPUs{where}")
    if gpus is not None and gpus != par.world:
        raise v.ConfigError(f"gpus={gpus} but tp*pp*dp={par.tp}*{par.pp}*{par.dp}={par.world}")


@dataclass(frozen=True)
class Gemm:
    """One TP-split GEMM of a layer, forward shape on one rank: (m x k) @ (k x n)."""

    name: str
    """qkv, proj, fc1, fc2 or lm_head."""
    m: int
    """Rows: the micro-batch's tokens (times top_k for experts)."""
    k: int
    """Reduction size on this rank."""
    n: int
    """Columns on this rank."""
    column: bool
    """Column-parallel (input gathered before it) or row-parallel (output reduced after it)."""


def layer_gemms(model: ModelConfig, par: ParallelConfig) -> list[Gemm]:
    """The four TP GEMMs of one layer (MoE: the expert MLP sees top_k times the tokens)."""
    t = par.micro_batch * model.seq_len
    tp, d = par.tp, model.head_dim
    kv_local = max(1, model.num_kv_heads // tp)
    mlp_tokens = t * model.top_k if model.num_experts > 1 else t
    up = (2 if model.gated_mlp else 1) * model.ffn_hidden // tp
    return [
        Gemm("qkv", t, model.hidden, (model.num_heads // tp + 2 * kv_local) * d, True),
        Gemm("proj", t, model.num_heads * d // tp, model.hidden, False),
        Gemm("fc1", mlp_tokens, model.hidden, up, True),
        Gemm("fc2", mlp_tokens, model.ffn_hidden // tp, model.hidden, False),
    ]
