"""A HuggingFace `config.json` read as a ModelConfig: the shapes whose GEMMs overlap has to hide behind.

Llama/Mistral/Qwen/Mixtral-style keys (hidden_size, intermediate_size, num_hidden_layers,
num_attention_heads, num_key_value_heads, head_dim, vocab_size, hidden_act, tie_word_embeddings,
num_local_experts / num_experts, num_experts_per_tok, moe_intermediate_size) and GPT-2-style
keys (n_embd, n_layer, n_head, n_inner, n_positions). A config.json says how long a sequence the
model *can* take, not the one it is trained on, so the sequence length is asked for.
"""

from __future__ import annotations

from . import _validate as v
from .model import ModelConfig

DEFAULT_SEQ_LEN = 4096
"""Sequence length used when a HuggingFace config is given without one (stated in the model's name)."""
GATED_ACTS = ("silu", "swiglu", "geglu", "gelu_pytorch_tanh_gated")
"""hidden_act values of gated (two up-projection) MLPs: Llama's SiLU is SwiGLU."""


def is_hf_config(d: dict) -> bool:
    """Whether a dict looks like a HuggingFace config rather than ModelConfig's own keys."""
    return isinstance(d, dict) and ("model_type" in d or "hidden_size" in d or "n_embd" in d)


def _get(d: dict, name: str, *keys, default=None):
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    if default is not None:
        return default
    raise v.ConfigError(f"{name}: HuggingFace config has none of the keys {', '.join(keys)}")


def from_hf_config(d: dict, name: str = "hf", seq_len: int | None = None) -> ModelConfig:
    """A ModelConfig from a HuggingFace config dict (see the module docstring for the keys read)."""
    o = f"model({name})"
    hidden = _get(d, o, "hidden_size", "n_embd", "d_model")
    gpt2 = "n_embd" in d
    act = str(d.get("hidden_act", d.get("activation_function", "gelu"))).lower()
    gated = not gpt2 and act in GATED_ACTS
    experts = _get(d, o, "num_local_experts", "num_experts", "n_routed_experts", default=1)
    moe_ffn = d.get("moe_intermediate_size")
    ffn = moe_ffn if experts > 1 and moe_ffn else _get(d, o, "intermediate_size", "n_inner", "ffn_dim",
                                                      default=4 * hidden if isinstance(hidden, int) else 1)
    heads = _get(d, o, "num_attention_heads", "n_head")
    for key in ("num_key_value_heads", "head_dim"):  # null: HF's default (all heads; hidden / heads); 0 is no size
        if d.get(key) is not None:
            v.positive_int(o, key, d[key])
    tied = d.get("tie_word_embeddings", gpt2)
    label = name if seq_len else f"{name} (seq_len {DEFAULT_SEQ_LEN} assumed)"
    return ModelConfig(
        hidden=hidden, ffn_hidden=ffn, num_layers=_get(d, o, "num_hidden_layers", "n_layer"),
        num_heads=heads, num_kv_heads=d.get("num_key_value_heads") or 0, head_dim=d.get("head_dim") or 0,
        seq_len=seq_len or DEFAULT_SEQ_LEN, vocab_size=_get(d, o, "vocab_size"), gated_mlp=gated,
        tied_embeddings=tied, num_experts=experts,
        top_k=d.get("num_experts_per_tok", 1) if experts > 1 else 1, name=label)
