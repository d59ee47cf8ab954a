"""Tiny HF decoders, prompts and greedy `generate()` shared by the decode and prefill tests."""

import torch

NEW = 4


def model(family: str, tp: int):
    import transformers as T

    kw = dict(hidden_size=16 * tp, intermediate_size=32 * tp, num_hidden_layers=2, num_attention_heads=2 * tp,
              num_key_value_heads=tp, vocab_size=32 * tp, max_position_embeddings=64, pad_token_id=0,
              attn_implementation="sdpa")
    config, cls = dict(llama=(T.LlamaConfig, T.LlamaForCausalLM), qwen3=(T.Qwen3Config, T.Qwen3ForCausalLM))[family]
    if family == "qwen3":
        kw["head_dim"] = 8
    torch.manual_seed(0)
    return cls(config(**kw)).eval()


def prompts(tp: int, length: int, batch: int, padded: bool):
    g = torch.Generator().manual_seed(length + batch)
    ids = torch.randint(1, 32 * tp, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        for row in range(1, batch):  # each later prompt shorter: left padding of a batch of lengths
            ids[row, :row], mask[row, :row] = 0, 0
    return ids, mask


def generate(model, ids, mask):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True, output_logits=True)
    return out.sequences, torch.stack(out.logits)
