"""`overlapkit plan` for a mixture of experts: expert weights, gradients and optimizer state divided by ep,
the expert gradients reduced over the dp/ep ranks holding the same experts, the all-to-all priced."""

import pytest

from overlapkit.costmodel import ModelConfig, Overlap, ParallelConfig, predict, preset
from overlapkit.costmodel.memory import ADAM_STATE_BYTES, GIB, WORKSPACE_GIB, estimate

# Mixtral-8x7B (mistralai/Mixtral-8x7B-v0.1 config.json)
MIXTRAL = ModelConfig(hidden=4096, ffn_hidden=14336, num_layers=32, num_heads=32, num_kv_heads=8, seq_len=4096,
                      vocab_size=32000, gated_mlp=True, tied_embeddings=False, num_experts=8, top_k=2, name="mixtral")


def analytic_gib(ep: int, dp: int = 8, zero: int = 1) -> dict:
    """Counted by hand from the config: 46.7 B parameters, 45.1 B of them in the experts."""
    h, f, layers, v = 4096, 14336, 32, 32000
    attention = h * (32 + 2 * 8) * 128 + 32 * 128 * h
    dense = layers * (attention + h * 8 + 2 * h) + 2 * v * h  # + router, norms; embedding and head
    experts = layers * 3 * h * f * 8
    assert 46.6e9 < dense + experts < 46.8e9
    on_rank = dense + experts / ep
    optimizer = (dense / dp + experts / ep / (dp // ep)) if zero else on_rank
    tokens = 4096
    return {"weights": 2 * on_rank / GIB, "gradients": 2 * on_rank / GIB,
            "optimizer": ADAM_STATE_BYTES * optimizer / GIB,
            "activations": 34 * tokens * h * layers / GIB, "logits": tokens * v * 8 / GIB, "workspace": WORKSPACE_GIB}


@pytest.mark.parametrize("ep", [1, 2, 8])
def test_mixtral_memory_is_the_analytic_count_at_every_ep(ep):
    par = ParallelConfig(dp=8, ep=ep, zero=1, global_batch=8)
    got = estimate(MIXTRAL, par, preset("h200-sxm"))
    want = analytic_gib(ep)
    assert got["total_gib"] == pytest.approx(sum(want.values()), rel=0.05)
    for part in ("weights", "gradients", "optimizer"):
        assert got["parts_gib"][part] == pytest.approx(want[part], rel=0.01), part


def test_ep_divides_the_experts_and_zero_shards_them_over_dp_over_ep():
    hw = preset("h200-sxm")
    m = {ep: estimate(MIXTRAL, ParallelConfig(dp=8, ep=ep, zero=0, global_batch=8), hw)["parts_gib"] for ep in (1, 8)}
    assert m[1]["weights"] / m[8]["weights"] > 6  # 46.7 B on a rank against 1.6 B dense + 5.6 B of experts
    assert m[8]["optimizer"] == pytest.approx(m[8]["weights"] * 6, rel=1e-9)  # unsharded: 12 B vs 2 B a parameter
    z1 = estimate(MIXTRAL, ParallelConfig(dp=8, ep=8, zero=1, global_batch=8), hw)["parts_gib"]
    assert z1["optimizer"] == pytest.approx(m[1]["optimizer"] / 8, rel=1e-9)  # ep x (dp/ep) = dp shards either way


def test_expert_gradients_reduce_over_dp_over_ep_and_the_all_to_all_is_priced():
    hw = preset("h200-sxm")
    run = {ep: predict(MIXTRAL, ParallelConfig(dp=8, ep=ep, global_batch=8, overlap=Overlap(dp="bulk")), hw)
           for ep in (1, 2, 8)}
    dp = {ep: r.comm_by_kind["dp_all_reduce"] for ep, r in run.items()}
    # ep = 8: experts have no other replica (dp/ep = 1); only the 1.6 B dense parameters reduce
    assert dp[8] < 0.1 * dp[1] and dp[8] < dp[2] < dp[1]
    assert "ep_all_to_all" not in run[1].comm_by_kind
    assert run[2].comm_by_kind["ep_all_to_all"] > 0 and run[8].comm_by_kind["ep_all_to_all"] > 0
    assert run[8].memory["total_gib"] < run[1].memory["total_gib"]
