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


SHRINK = {
    # experts and routing
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4, "num_experts_per_tok": 2,
    "moe_k": 2, "top_k": 2, "n_group": 1, "topk_group": 1, "n_shared_experts": 1, "zero_expert_num": 0,
    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "expert_ffn_hidden_size": 16,
    "moe_shared_expert_intermediate_size": 16, "intermediate_size_mlp": 64,
    # low-rank attention (MLA)
    "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
    "qk_head_dim": 16,
    # linear attention and state-space mixers
    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "ssm_state_size": 8, "mamba_num_heads": 4, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8,
    "mamba_head_dim": 16, "mamba_d_ssm": 64, "mamba_n_groups": 1, "n_groups": 1, "chunk_size": 8, "mamba_chunk_size": 8,
}
"""Size fields of the larger families, set small wherever a config has them (by field, not by family)."""


def families_with_a_plan() -> list[str]:
    """model_type of every causal LM of the installed transformers whose config ships a base_model_tp_plan."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(mt for mt, cls in CONFIG_MAPPING_NAMES.items() if mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
                  and getattr(getattr(transformers, cls, None), "base_model_tp_plan", None))


def any_config(family: str, tp: int):
    """`config(family, tp)` with every SHRINK field the family's config has set small."""
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(family).to_dict()
    return config(family, tp, **{k: v for k, v in SHRINK.items() if k in defaults})


MAX_PARAMS = 2_000_000
"""A tiny config above this still has a large size field: not built (it would cost seconds and GiBs a rank)."""


class TooBig(ValueError):
    """The family's tiny config is not tiny."""


def build_any(family: str, tp: int, seed: int = 0):
    """`build` on `any_config`: every family's model, tiny."""
    from transformers import AutoModelForCausalLM

    cfg = any_config(family, tp)
    with torch.device("meta"):
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    if size > MAX_PARAMS:
        raise TooBig(f"{size / 1e6:.1f} M parameters at the tiny config (a size field SHRINK does not know)")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5) if "norm" in name or "ln" in name else p.uniform_(-0.1, 0.1)
    return model.float().eval()
