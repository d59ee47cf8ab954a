"""A transformer split over GPUs: the model loaded from a preset or a file, and the GEMMs of one layer
on one rank, the compute that the TP collectives meet.

`ModelConfig` (model.py) says what one layer computes; `ParallelConfig` (parallel.py) says how TP, SP,
PP, DP, EP and ZeRO split it; both are re-exported here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from . import _validate as v
from .hf import from_hf_config, is_hf_config
from .model import MAX_DIM, MODEL_PRESETS, ModelConfig  # noqa: F401 (re-exported)
from .parallel import MODES, RECOMPUTE, TRANSPORTS, Overlap, ParallelConfig, validate  # noqa: F401 (re-exported)


def load_model(spec: "str | Path | ModelConfig", seq_len: int | None = None) -> ModelConfig:
    """A preset name, a JSON file (ModelConfig's keys, or a HuggingFace config.json), or a ModelConfig.

    `seq_len` replaces the model's sequence length (a HuggingFace config does not say it)."""
    if seq_len is not None and (not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1):
        raise v.ConfigError(f"seq_len={seq_len!r}: must be an integer >= 1 (leave it out for the model's own)")
    if isinstance(spec, ModelConfig):
        return replace(spec, seq_len=seq_len) if seq_len else spec
    if str(spec) in MODEL_PRESETS:
        return load_model(MODEL_PRESETS[str(spec)], seq_len)
    path = Path(spec)
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise v.ConfigError(f"model={str(spec)!r}: no such file")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise v.ConfigError(f"model={str(spec)!r}: not valid JSON ({e.msg} at line {e.lineno})") from None
        if is_hf_config(data):
            return from_hf_config(data, path.parent.name if path.stem == "config" else path.stem, seq_len)
        if not isinstance(data, dict):
            raise v.ConfigError(f"model={str(spec)!r}: must be a JSON object, not {type(data).__name__}")
        return load_model(ModelConfig.from_dict({"name": path.stem, **data}), seq_len)
    raise v.ConfigError(f"model={str(spec)!r}: unknown preset; known: {', '.join(MODEL_PRESETS)} "
                        f"(or a path to a JSON file)")


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


def layer_gemms(model: ModelConfig, par: ParallelConfig, seq: int | None = None) -> list[Gemm]:
    """The four TP GEMMs of one layer (MoE: the expert MLP sees top_k times the tokens).

    `seq`: tokens of a sequence on this rank (seq_len / cp under context parallelism)."""
    t = par.micro_batch * (seq or model.seq_len // par.cp)
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
