"""FLOPs of a training step under the conventions publications use, and TFLOP/s per GPU and MFU.

A published "TFLOP/s per GPU" is a FLOP count divided by step time and GPU count; the count is
a convention, so comparing the model with a publication needs the same one:

- `narayanan`: 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) (Narayanan et al. SC21; counts the full
  recomputation's extra forward, GPT-style MLP).
- `megatron2024`: 12·B·s·l·h²·[(1 + g/a + s/h) + (ffn/h)·m + V/(2·l·h)] with g the key/value
  heads, a the heads, m = 3/2 for a gated MLP (Megatron-LM `num_floating_point_operations`, mid-2024).
- `palm`: 6·P·T + 12·l·h·s·T with P the non-embedding matmul parameters, T = B·s tokens
  (PaLM, appendix B; what Llama 3 and torchtitan report).
"""

from __future__ import annotations

from . import _validate as v

CONVENTIONS = ("narayanan", "megatron2024", "palm")


def step_flops(model, global_batch: int, convention: str = "megatron2024", num_layers: int | None = None) -> float:
    """FLOPs of one optimizer step of `global_batch` sequences under `convention`."""
    v.one_of("flops", "convention", convention, CONVENTIONS)
    b, s, h, vocab = global_batch, model.seq_len, model.hidden, model.vocab_size
    n = num_layers or model.num_layers
    if convention == "narayanan":
        return 96.0 * b * s * n * h * h * (1 + s / (6 * h) + vocab / (16 * n * h))
    if convention == "megatron2024":
        gated = 1.5 if model.gated_mlp else 1.0
        attn = 1 + model.num_kv_heads / model.num_heads + s / h
        return 12.0 * b * s * n * h * h * (attn + model.ffn_hidden / h * gated * model.top_k + vocab / (2 * n * h))
    d = model.head_dim
    attn = h * (model.num_heads + 2 * model.num_kv_heads) * d + model.num_heads * d * h
    mlp = (3 if model.gated_mlp else 2) * h * model.ffn_hidden * model.top_k
    tokens = b * s
    return 6.0 * n * (attn + mlp) * tokens + 12.0 * n * h * s * tokens


def throughput(model, par, step_s: float, peak_tflops: float, convention: str = "megatron2024") -> dict:
    """TFLOP/s per GPU and MFU (share of the dense peak) of a step under `convention`."""
    f = step_flops(model, par.global_batch, convention)
    tflops = f / (step_s * par.world) / 1e12 if step_s > 0 else 0.0
    return {"convention": convention, "step_flops": f, "tflops_per_gpu": tflops,
            "mfu": tflops / peak_tflops if peak_tflops else 0.0}
