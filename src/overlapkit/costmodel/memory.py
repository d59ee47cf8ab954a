"""Memory per GPU of a configuration: whether the step that overlap speeds up fits at all.

Weights, gradients and Adam state per rank (sharded by ZeRO stage over the ranks that hold the same
parameter: dp·cp for dense weights, dp·cp/ep for a mixture of experts' expert weights, which expert
parallelism divides over ep), activations of the micro-
batches in flight on the first stage (1F1B holds pp of them), the logits of the last stage and
the parameters prefetched ahead under ZeRO-3. Activation bytes per layer follow Korthikanti et al.
2022 (arXiv 2205.05198, Table 2): s·b·h·(10 + 24/t + 5·a·s/(h·t)) without SP, s·b·h·34/t with
SP; the 5·a·s/h score term only where scores are materialized (unfused attention without
selective recomputation); full recomputation keeps only each layer's input (2·s·b·h), per-op
selective recomputation about half.
"""

from __future__ import annotations

from .params import rank_params, shards

GIB = 2**30
ADAM_STATE_BYTES = 12
"""fp32 master weights, first and second moments per parameter."""
WORKSPACE_GIB = 4.0
"""CUDA context, NCCL buffers, cuBLAS workspace and allocator fragmentation (a stated allowance)."""


def estimate(model, par, hw, prefetch_units: int = 0) -> dict:
    """Bytes per GPU by part, the total, and whether it fits the GPU's HBM."""
    db = 2 if par.dtype != "fp8" else 1
    p = max((rank_params(model, par, i) for i in range(par.pp)), key=lambda r: r.total)
    dense_dp, expert_dp = shards(par)

    def sharded(bytes_per_param: float, from_stage: int) -> float:
        """Bytes of a per-parameter state, divided over its replicas from ZeRO stage `from_stage` on."""
        if par.zero < from_stage:
            return p.total * bytes_per_param
        return (p.dense / dense_dp + p.expert / expert_dp) * bytes_per_param

    if par.weights == "autocast":  # fp32 parameters and gradients; Adam's moments only (no master copy)
        weights, grads, optimizer = sharded(4, 3), sharded(4, 2), sharded(ADAM_STATE_BYTES - 4, 1)
    else:
        weights, grads, optimizer = sharded(2, 3), sharded(par.grad_bytes, 2), sharded(ADAM_STATE_BYTES, 1)
    s, b, h, t = model.seq_len // par.cp, par.micro_batch, model.hidden, par.tp
    if par.recompute == "full":
        per_layer = 2.0 * s * b * h / (t if par.sp else 1)
    else:
        per_layer = s * b * h * (34.0 / t if par.sp else 10.0 + 24.0 / t)
        if par.attention == "unfused" and par.recompute != "selective":
            per_layer += 5.0 * model.num_heads * s * s * b / t
        if par.recompute == "op":  # every other matmul's output recomputed instead of kept
            per_layer *= 0.5
    layers = max(par.stage_layers(model.num_layers))
    in_flight = min(par.pp, par.micro_batches)
    activations = per_layer * layers * in_flight
    logits = s * b * model.vocab_size / t * 4 * 2  # fp32 logits and their gradient
    prefetch = prefetch_units * par.zero3_wrap * model.layer_params / t * db if par.zero == 3 else 0.0
    # autocast's cast copies, kept for backward by the GEMMs that read them
    casts = p.total * db if par.weights == "autocast" else 0.0
    parts = {"weights": weights, "weight casts": casts, "gradients": grads, "optimizer": optimizer, "activations": activations,
             "logits": logits, "prefetch": prefetch, "workspace": WORKSPACE_GIB * GIB}
    total = sum(parts.values())
    return {"parts_gib": {k: x / GIB for k, x in parts.items()}, "total_bytes": total, "total_gib": total / GIB,
            "capacity_gib": hw.hbm_gib, "fits": total <= hw.hbm_gib * GIB}
