"""Model sizes more than one benchmark runs: the Llama 3 shapes of the TP benchmarks (from the cost
model's MODEL_PRESETS, the one table of published configurations), the data-parallel and ZeRO-3 GPTs,
and the tiny GPT of every smoke run."""

from __future__ import annotations

from overlapkit.costmodel import MODEL_PRESETS

TP_MODELS = ("llama3-8b", "llama3-70b")
"""The models whose TP GEMMs and layers tp_overlap, tp_host_cost, tp_chunk_profile and tp_step_gaps time."""


def tp_shapes(name: str) -> dict:
    """hidden, MLP width, query heads and key/value heads of a MODEL_PRESETS model (head dim hidden / heads)."""
    c = MODEL_PRESETS[name]
    return dict(hidden=c.hidden, ffn=c.ffn_hidden, heads=c.num_heads, kv_heads=c.num_kv_heads)


MODELS = {name: tp_shapes(name) for name in TP_MODELS}

DP_PRESETS = {  # dp_overlap.py and dp_overhead_probe.py
    # Small enough that 2 CPU ranks step in ~0.1 s, big enough (5 M parameters, 21 MB of fp32
    # gradients) that the all-reduce is a real share of the step. 4 MiB buckets (for both
    # overlapkit and DDP) give this small model several buckets to overlap, as 25 MiB do a big one.
    "cpu": dict(gpt=dict(vocab_size=4096, seq_len=64, hidden=256, num_heads=4, ffn_hidden=1024, num_layers=4),
                batch=1, bucket_mb=4.0),
    "cuda": dict(gpt=dict(vocab_size=32768, seq_len=512, hidden=1024, num_heads=16, ffn_hidden=4096, num_layers=8),
                 batch=8, bucket_mb=25.0),
    # ~0.94 B parameters (3.8 GB of fp32 gradients): the multi-GPU comparison with DDP.
    "cuda-1b": dict(gpt=dict(vocab_size=32768, seq_len=1024, hidden=2048, num_heads=16, ffn_hidden=8192, num_layers=16),
                    batch=4, bucket_mb=25.0),
}

FSDP_PRESETS = {  # fsdp_overlap.py and probes/fsdp_twin_phases.py
    # 8 blocks of 0.8 M parameters (3 MB of fp32 each): one gather per block is a real share of a block's compute.
    "cpu": dict(gpt=dict(vocab_size=2048, seq_len=64, hidden=256, num_heads=4, ffn_hidden=1024, num_layers=8), batch=2),
    "cuda": dict(gpt=dict(vocab_size=32768, seq_len=1024, hidden=2048, num_heads=16, ffn_hidden=8192, num_layers=16),
                 batch=4),
}

SMOKE_GPT = dict(vocab_size=64, seq_len=16, hidden=32, num_heads=2, ffn_hidden=64, num_layers=2)
"""The GPT of a smoke run (--smoke): every code path of a script, in milliseconds a step."""
SMOKE_DP = dict(gpt=SMOKE_GPT, batch=1, bucket_mb=0.01)
"""dp_overlap / dp_overhead_probe under --smoke: buckets small enough that the GPT has several."""
