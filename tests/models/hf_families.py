"""Tiny configs of the transformers causal-LM families that ship a tensor-parallel plan, sized to split over tp."""

import torch

FAMILIES = ("llama", "qwen2", "mistral", "gemma", "gemma2", "qwen3", "phi3", "olmo", "olmo2", "gpt_neox", "cohere",
            "granite", "starcoder2", "phi")
"""model_type of every family tested (each builds from a tiny config on transformers 5.17 and 5.24)."""


def config(family: str, tp: int, **extra):
    """A 2-layer config whose heads, KV heads, MLP and vocabulary split over tp (head_dim 8)."""
    from transformers import AutoConfig

    heads, kv = {1: (4, 2), 2: (4, 2), 3: (6, 3), 4: (8, 4)}[tp]
    hidden = 8 * heads
    kw = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=heads,
              num_key_value_heads=kv, head_dim=8, vocab_size=32 * tp, max_position_embeddings=64,
              pad_token_id=1, bos_token_id=0, eos_token_id=2, attn_implementation="eager")
    if family == "gpt_neox":
        kw["rotary_pct"] = 1.0
    kw.update(extra)
    cfg = AutoConfig.for_model(family, **kw)
    return cfg


def build(family: str, tp: int, seed: int = 0, **extra):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(family, tp, **extra))
    with torch.no_grad():  # norms not all ones, biases not all zeros: a wrong norm or bias gradient must show
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5) if "norm" in name or "ln" in name else p.uniform_(-0.1, 0.1)
    return model.float().eval()
