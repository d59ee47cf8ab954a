"""The step model: seed 003's TP message, r per kind, auto never slower, PP/ZeRO/EP, bad sizes."""

import pytest

from overlapkit.costmodel import MODEL_PRESETS, ConfigError, ModelConfig, Overlap, ParallelConfig, predict, preset
from overlapkit.costmodel.schedule import layer_tasks, step_tasks
from overlapkit.costmodel.simulate import makespan, simulate

H200 = preset("h200-sxm")
L8, L70 = MODEL_PRESETS["llama3-8b"], MODEL_PRESETS["llama3-70b"]


@pytest.mark.parametrize("hw", ["h100-sxm", "h200-sxm"])
def test_seed_tp_message_and_its_comm_to_compute_ratio_at_tp8(hw):
    """b=1, s=4096, h=7168 bf16: a 58.7 MB all-reduce; over a layer's GEMMs at TP=8, 0.05-0.6."""
    model = ModelConfig(hidden=7168, ffn_hidden=4 * 7168, num_layers=1, num_heads=56, seq_len=4096,
                        vocab_size=32000, gated_mlp=False)
    r = predict(model, ParallelConfig(tp=8, sp=False), preset(hw))
    ar = [row for row in r.layer_fwd.rows if row.get("comm") == "tp_all_reduce"]
    assert len(ar) == 2 and ar[0]["nbytes"] == 4096 * 7168 * 2 == pytest.approx(58.7e6, rel=1e-3)
    gemms = sum(row["gemm_ms"] for row in r.layer_fwd.rows if row["op"].split()[0] in ("qkv", "proj", "fc1", "fc2"))
    assert 0.1 <= ar[0]["comm_ms"] <= 0.35
    assert 0.05 <= ar[0]["comm_ms"] / gemms <= 0.6


def test_without_overlap_everything_is_exposed():
    r = predict(L70, ParallelConfig(tp=8, pp=2, dp=2, global_batch=8), H200)
    assert r.exposed_by_kind == pytest.approx(r.comm_by_kind)
    assert all(r.r(k) == pytest.approx(0.0) for k in r.comm_by_kind)
    assert r.step_ms == pytest.approx(r.compute_ms + r.comm_ms + r.bubble_ms)
    assert set(r.comm_by_kind) == {"tp_all_gather", "tp_reduce_scatter", "pp_send", "dp_all_reduce"}


CONFIGS = [(L8, dict(tp=8, dp=2)), (L70, dict(tp=8, pp=4, dp=2, global_batch=16)),
           (L70, dict(tp=4, pp=2, vpp=2, dp=2, global_batch=8, recompute="full")),
           (MODEL_PRESETS["gpt3-175b"], dict(tp=8, pp=8, dp=2, global_batch=32, zero=1)),
           (L8, dict(tp=2, dp=4, zero=3, global_batch=8)), (L8, dict(tp=8, sp=False, dp=2))]


@pytest.mark.parametrize("model,kw", CONFIGS)
def test_auto_is_never_slower_than_a_fixed_choice_and_r_is_a_share(model, kw):
    steps = {}
    for mode in ("none", "bulk", "pipelined", "auto"):
        r = predict(model, ParallelConfig(**kw, overlap=Overlap.all(mode)), H200)
        steps[mode] = r.step_ms
        for k in r.comm_by_kind:
            assert 0.0 <= r.exposed_by_kind[k] <= r.comm_by_kind[k] * 1.2 + 1e-9  # contention may add a little
            assert r.r(k) <= 1.0
    assert steps["auto"] <= min(steps.values()) * (1 + 1e-9)
    assert steps["auto"] < steps["none"]


def test_pipelined_tp_hides_more_than_bulk_which_hides_more_than_none():
    r = {m: predict(L70, ParallelConfig(tp=8, overlap=Overlap(tp=m)), H200) for m in ("none", "bulk", "pipelined")}
    assert r["none"].exposed_ms > r["bulk"].exposed_ms > r["pipelined"].exposed_ms > 0
    # bulk hides only backward collectives: forward rows keep mode none
    assert {row["mode"] for row in r["bulk"].layer_fwd.rows if "comm" in row} == {"none"}
    assert {row["mode"] for row in r["pipelined"].layer_fwd.rows if "comm" in row} == {"pipelined"}


def test_pipeline_bubble_and_interleaving():
    par = ParallelConfig(tp=8, pp=4, global_batch=16)
    r1 = predict(L70, par, H200)
    r2 = predict(L70, ParallelConfig(tp=8, pp=4, vpp=2, global_batch=16), H200)
    per_mb = r1.layers_per_stage * (r1.layer_fwd.wall_ms + r1.layer_bwd.wall_ms) + r1.head_fwd.wall_ms + r1.head_bwd.wall_ms
    # The last stage (with the LM head) sets the pace; fill and drain are the other stages' times.
    assert r1.stage_ms[-1] == pytest.approx(per_mb) and max(r1.stage_ms) == r1.stage_ms[-1]
    # without p2p overlap the fill and the drain also wait for each of their 2(pp - 1) hops' transfers
    hop = r1.comm_by_kind["pp_send"] / (2 * r1.par.micro_batches)
    assert r1.bubble_ms == pytest.approx(sum(r1.stage_ms[:-1]) + 2 * 3 * hop)
    assert 2.9 * per_mb * 0.8 < r1.bubble_ms < 3 * per_mb
    assert r2.bubble_ms - 6 * hop == pytest.approx((r1.bubble_ms - 6 * hop) / 2, rel=0.02)
    assert r1.comm_by_kind["pp_send"] == pytest.approx(2 * 16 * r1.comm_by_kind["pp_send"] / 32)


def test_recompute_costs_forward_compute_again():
    c = {rc: predict(L8, ParallelConfig(tp=8, recompute=rc), H200) for rc in ("none", "selective", "full")}
    assert c["none"].compute_ms < c["selective"].compute_ms < c["full"].compute_ms
    layer_f = c["none"].layer_fwd.compute_ms
    assert c["full"].compute_ms - c["none"].compute_ms == pytest.approx(32 * layer_f, rel=1e-6)
    assert c["full"].comm_ms > c["none"].comm_ms  # the forward's TP collectives run again


def test_zero_stages_change_the_collectives():
    kinds = {z: set(predict(L8, ParallelConfig(tp=8, dp=4, zero=z, global_batch=8), H200).comm_by_kind)
             for z in (0, 1, 3)}
    assert "dp_all_reduce" in kinds[0] and "zero_all_gather" not in kinds[0]
    assert {"dp_reduce_scatter", "zero_all_gather"} <= kinds[1]
    z3 = {m: predict(L8, ParallelConfig(tp=8, dp=4, zero=3, global_batch=4 * m), H200) for m in (1, 2)}
    assert z3[2].comm_by_kind["zero_all_gather"] == pytest.approx(2 * z3[1].comm_by_kind["zero_all_gather"])
    prefetched = predict(L8, ParallelConfig(tp=8, dp=4, zero=3, overlap=Overlap(zero="pipelined")), H200)
    assert prefetched.exposed_by_kind["zero_all_gather"] < z3[1].exposed_by_kind["zero_all_gather"]


def test_expert_all_to_all_hides_behind_chunked_expert_gemms():
    moe = ModelConfig(hidden=4096, ffn_hidden=14336, num_layers=8, num_heads=32, num_kv_heads=8, seq_len=4096,
                      vocab_size=32000, num_experts=8, top_k=2)
    none = predict(moe, ParallelConfig(tp=2, dp=8, ep=8), H200)
    chunked = predict(moe, ParallelConfig(tp=2, dp=8, ep=8, overlap=Overlap(ep="pipelined")), H200)
    assert none.exposed_by_kind["ep_all_to_all"] == pytest.approx(none.comm_by_kind["ep_all_to_all"])
    assert chunked.exposed_by_kind["ep_all_to_all"] < none.exposed_by_kind["ep_all_to_all"]
    assert moe.params > 8 * 8 * 3 * 4096 * 14336
    r = chunked
    assert makespan(simulate(layer_tasks(r))) == pytest.approx(r.layer_fwd.wall_ms + r.layer_bwd.wall_ms, rel=1e-6)


@pytest.mark.parametrize("mode", ["none", "bulk", "auto"])
def test_simulated_schedules_agree_with_the_analytic_step(mode):
    for kw in (dict(tp=8, dp=8, global_batch=16), dict(tp=8, pp=4, dp=2, global_batch=16)):
        r = predict(L70, ParallelConfig(**kw, overlap=Overlap.all(mode)), H200)
        assert makespan(simulate(layer_tasks(r))) == pytest.approx(r.layer_fwd.wall_ms + r.layer_bwd.wall_ms, rel=1e-6)
        assert makespan(simulate(step_tasks(r, H200))) == pytest.approx(r.step_ms, rel=0.03)


def test_report_dict_has_the_documented_keys():
    d = predict(L8, ParallelConfig(tp=8, dp=2), H200).to_dict()
    for key in ("step_time_s", "compute_s", "comm_s", "exposed_comm_s", "bubble_s", "by_kind", "layer_rows",
                "recommendations"):
        assert key in d
    assert d["step_time_s"] == pytest.approx(d["compute_s"] + d["exposed_comm_s"] + d["bubble_s"])
    assert {"op", "gemm_ms", "time_ms"} <= set(d["layer_rows"][0])


@pytest.mark.parametrize("model,kw,field", [
    (L8, dict(tp=3), "num_heads=32 is not divisible by tp=3"),
    (L70, dict(tp=8, pp=3), "num_layers=80 is not divisible by pp\\*vpp=3"),
    (L70, dict(tp=8, pp=4, vpp=3, global_batch=4), "num_layers=80 is not divisible by pp\\*vpp=12"),
    (L8, dict(tp=16), "tp=16 exceeds gpus_per_node=8"),
    (L8, dict(tp=4, dp=3), "world size tp\\*cp\\*pp\\*dp=12 does not fill whole nodes of 8"),
    (L70, dict(tp=8, pp=2, vpp=2, global_batch=3), "interleaved 1F1B"),
    (L8, dict(tp=8, dp=2, ep=2), "ep=2 needs a mixture-of-experts"),
])
def test_bad_sizes_fail_with_a_line_naming_the_field(model, kw, field):
    with pytest.raises(ConfigError, match=field):
        predict(model, ParallelConfig(**kw), H200)


def test_config_construction_errors_name_the_field():
    with pytest.raises(ConfigError, match="global_batch=10 is not divisible by micro_batch\\*dp=4"):
        ParallelConfig(dp=4, global_batch=10)
    with pytest.raises(ConfigError, match="vpp=2 needs pp > 1"):
        ParallelConfig(vpp=2)
    with pytest.raises(ConfigError, match="overlap.tp='fast'"):
        Overlap(tp="fast")
    with pytest.raises(ConfigError, match="num_heads=32 is not divisible by num_kv_heads=5"):
        ModelConfig(hidden=4096, ffn_hidden=1, num_layers=1, num_heads=32, num_kv_heads=5, seq_len=1, vocab_size=1)
    with pytest.raises(ConfigError, match="gpus=16 but tp\\*cp\\*pp\\*dp=8\\*1\\*1\\*1=8"):
        predict(L8, ParallelConfig(tp=8), H200, gpus=16)


def test_presets_have_their_published_sizes():
    assert L8.params == pytest.approx(8.03e9, rel=0.01)
    assert L70.params == pytest.approx(70.6e9, rel=0.01)
    assert MODEL_PRESETS["llama3-405b"].params == pytest.approx(405.9e9, rel=0.01)
    assert MODEL_PRESETS["gpt3-175b"].params == pytest.approx(174.6e9, rel=0.01)
