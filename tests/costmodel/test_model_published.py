"""Predictions against published per-operation results (Flux) and speed-ups (PyTorch async-TP).

The numbers and their sources live in benchmarks/model_vs_measured.py, which writes the error
table of docs/model.md; these checks keep the errors inside the bands reported there.
"""

from pathlib import Path

import pytest



def test_flux_ag_gemm_and_gemm_rs_times(bench):
    rows = bench.flux_rows()
    assert len(rows) == 16
    for r in rows:
        assert abs(bench.err(r["predicted"], r["measured"])) < 20.0, r
    by = {r["what"]: r["predicted"] for r in rows}
    for label in ("AG+GEMM A800", "GEMM+RS A800", "AG+GEMM H800", "GEMM+RS H800"):
        overlapped = next(v for k, v in by.items() if k.startswith(f"Flux {label}: overlapped"))
        gemm, total = by[f"Flux {label}: GEMM"], by[f"Flux {label}: sequential total"]
        assert gemm < overlapped < total  # overlap pays, but the GEMM alone stays the floor


def test_async_tp_speedups(bench):
    rows = {r["what"]: r for r in bench.async_tp_rows()}
    for name in ("llama3-8b", "llama3-70b"):
        fwd, e2e = rows[f"async-TP {name} forward speed-up"], rows[f"async-TP {name} end-to-end speed-up"]
        assert fwd["predicted"] == pytest.approx(fwd["measured"], rel=0.12)
        assert e2e["predicted"] == pytest.approx(e2e["measured"], rel=0.2)
        assert 1.0 < e2e["predicted"] < fwd["predicted"]  # backward and FSDP dilute the forward's gain


def test_seed_worked_examples_reproduce(bench):
    rows = bench.worked_examples()
    for r in rows[:4]:
        assert r["predicted"] == pytest.approx(r["measured"], rel=2e-3), r
    bf16 = [r for r in rows[4:] if "bf16" in r["what"]]
    assert bf16 and all(0.05 <= r["predicted"] <= 0.6 for r in bf16)


def test_engine_benchmark_results_are_predicted_when_present(bench, tmp_path):
    """The shape of tp_overlap.py / dp_overlap.py CUDA results; values made up to exercise the reader.

    tp_overlap.py records the unsharded layer's K x N and the TP degree; the GEMM it times is
    one rank's shard (N / tp for a column layer like qkv)."""
    tp = {"device": "NVIDIA H200", "world": 1, "tokens": 8192, "summary": {"gemms": {"llama3-70b qkv": {
        "kind": "ag", "K": 8192, "N": 1280 * 8, "tp": 8,
        "rows": {"gemm": {"ms": 0.21}, "pipelined p2p c=8": {"ms": 0.32},
                 "pipelined symm_mem c=4": {"ms": None, "error": "x"}}}}}}
    dp = {"device": "NVIDIA H200", "world": 1, "preset": {"gpt": dict(vocab_size=32768, seq_len=512, hidden=1024,
          num_heads=16, ffn_hidden=4096, num_layers=8), "batch": 8, "bucket_mb": 25.0},
          "rows": {"no communication": {"step_ms": 20.0}, "overlapkit overlap=True": {"comm_ms": None}}}
    import json
    (tmp_path / "tp_overlap_cuda_ws1.json").write_text(json.dumps(tp))
    (tmp_path / "dp_overlap_cuda.json").write_text(json.dumps(dp))
    rows = {r["what"]: r for r in bench.engine_rows(tmp_path)}
    gemm = rows["TP benchmark llama3-70b qkv (M=8192, K=8192, N=1280): GEMM"]
    assert gemm["predicted"] == pytest.approx(0.2137, rel=0.01)  # a fitted shape: the measured table value
    chunked = rows["TP benchmark llama3-70b qkv: pipelined p2p c=8"]
    assert chunked["predicted"] == pytest.approx(0.2137 / 0.6254, rel=0.02)  # 8 chunks at 0.63 efficiency
    dp_row = next(r for k, r in rows.items() if k.startswith("DP benchmark GPT, world 1: step without communication"))
    assert len(rows) == 3 and dp_row["predicted"] > 0
    assert bench.engine_rows(tmp_path / "nothing") == []


def test_lm_head_probe_results_are_predicted_when_present(bench, tmp_path):
    """lm_head_probe.py's CUDA format; made-up times exercise the reader, the prediction is the model's."""
    import json

    d = {"device": "NVIDIA H200", "rows": [{"tokens": 8192, "hidden": 4096, "vocab": 128256,
                                             "gemm_ms": 10.0, "fwd_ms": 20.0, "fwd_bwd_ms": 50.0}]}
    (tmp_path / "lm_head_probe_cuda.json").write_text(json.dumps(d))
    rows = bench.engine_rows(tmp_path)
    assert [r["measured"] for r in rows] == [20.0, 50.0]
    # the head GEMM (8192 x 4096 x 128256) plus CE_BYTES[0] per fp32 logit at the H200's elementwise rate
    from overlapkit.costmodel.layer import CE_BYTES

    gemm = bench.preset("h200-sxm").gemm_ms(8192, 4096, 128256)
    ce = 8192 * 128256 * CE_BYTES[0] / (bench.preset("h200-sxm").memory.elementwise_gbps * 1e6)
    assert rows[0]["predicted"] == pytest.approx(gemm + ce)


@pytest.fixture(scope="module")
def published_cases(mvp):
    """The 30 cases of shared/published_steps/cases.json; skips where the folder is absent."""
    import json

    folder = mvp.published_dir(None)
    if folder is None:
        pytest.skip("shared/published_steps/cases.json absent")
    return json.loads((folder / "cases.json").read_text())["cases"]


def test_published_benchmark_prices_megatron_core_buckets_fp32_reduction_and_stated_interleaving(mvp):
    """megatron-core-2024: buckets of max(40M, 1M x dp) elements at r0.8's fp32 reduction; the README's
    pipelined rows interleaved (its PP communication is overlapped, which Megatron-Core does only then)."""
    model = {"hidden": 12288, "ffn_hidden": 49152, "num_layers": 96, "num_heads": 96, "seq_len": 4096,
             "vocab_size": 131072, "gated_mlp": False, "tied_embeddings": False}
    case = {"source": "MegatronLM-README-H100", "case": "177B", "model": model, "hardware": "h100-sxm", "tp": 8,
            "pp": 6, "vpp": 1, "dp": 48, "micro_batch": 1, "global_batch": 1152, "recompute": "none", "sp": True,
            "zero": 1, "overlap": {"tp": "auto", "dp": "bulk", "pp": "bulk", "zero": "pipelined"}}
    _, par, _ = mvp.config(case)
    assert par.vpp == 2 and par.grad_bytes == 4 and par.bucket_mib == pytest.approx(48e6 * 4 / 2**20)
    odd = dict(case, case="119B", model=dict(model, num_layers=92), pp=4, dp=96, global_batch=1536)
    _, par, _ = mvp.config(odd)  # 23 layers per stage: one per virtual stage
    assert par.vpp == 23 and par.bucket_mib == pytest.approx(96e6 * 4 / 2**20) and par.dp_in_drain


def test_published_benchmark_takes_sc21s_ddp_per_row_and_mt_nlgs_bf16(mvp, published_cases):
    """run_table_1.sh: torch DDP (autograd accumulation) up to 18B, local DDP (a buffer add every
    micro-batch) from 39B; MT-NLG trained in bf16 under DeepSpeed (autograd accumulation)."""
    by = {(c["source"], c["case"]): mvp.config(c)[1] for c in published_cases}
    assert by[("Narayanan21-T1", "18B")].grad_accumulation == "autograd"
    assert by[("Narayanan21-T1", "39B")].grad_accumulation == "hook"
    assert {(p.dtype, p.grad_accumulation) for (s, _), p in by.items() if s == "MT-NLG-530B"} == {("bf16", "autograd")}
    assert by[("MegatronLM-README-H100", "32B")].grad_accumulation == "fused"  # gradient_accumulation_fusion
    assert mvp.describe("Narayanan21-T1").startswith("--stack megatron-2021; --fp16 (")
    assert "--grad-accumulation autograd for 1.7B 3.6B 7.5B 18B (" in mvp.describe("Narayanan21-T1")


def test_bf16_reduction_rows_are_the_megatron_core_rows_only(mvp, published_cases):
    """The other design (bf16 gradient reduction) covers the Megatron-Core rows, not SC21's."""
    cases = [c for c in published_cases if c["source"].startswith("MegatronLM-README")][2:4]
    rows = mvp.bf16_reduce_rows(cases + [c for c in published_cases if c["source"] == "Narayanan21-T1"][:1])
    assert [r["case"] for r in rows] == [c["case"] for c in cases]
    assert all(r["error_pct"] < mvp.run_case(c)["error_pct"] for r, c in zip(rows, cases))  # bf16 moves less


def test_sustained_clocks_are_derived_not_fitted_on_the_published_steps():
    """The 700 W H100 sustains the 500 W measurement moved along P ~ f^3; the A100 its MAMF as published."""
    from overlapkit.costmodel.hardware import POWER_LIMIT_CLOCK, SUSTAINED_CLOCK, power_limited_clock

    assert SUSTAINED_CLOCK["h100-sxm"] == pytest.approx(POWER_LIMIT_CLOCK * (700 / 500) ** (1 / 3), rel=1e-12)
    assert SUSTAINED_CLOCK["a100-sxm-80g"] == 1.0
    assert power_limited_clock(500) == POWER_LIMIT_CLOCK and power_limited_clock(5000) == 1.0


def test_power_limit_clock_is_the_least_squares_value_of_its_own_runs(mvp):
    """POWER_LIMIT_CLOCK is fitted on torchtitan's async-TP runs (not published steps the model is judged
    by): it must stay their least-squares value (refit: model_vs_published.py --fit-power-limit)."""
    from overlapkit.costmodel.hardware import POWER_LIMIT_CLOCK

    assert mvp.fit_power_limit_clock() == pytest.approx(POWER_LIMIT_CLOCK, abs=0.005)
    at = mvp.power_limit_loss(POWER_LIMIT_CLOCK)
    assert at < mvp.power_limit_loss(POWER_LIMIT_CLOCK - 0.02) and at < mvp.power_limit_loss(POWER_LIMIT_CLOCK + 0.02)


def test_holding_each_source_out_of_every_fit_moves_the_mean_less_than_a_point(mvp, published_cases):
    cases = [c for c in published_cases if c["source"] in ("torchtitan-perf", "MegatronLM-README-H100-strong")]
    held = mvp.held_out(cases)
    assert set(held["by_source"]) == {"torchtitan-perf", "MegatronLM-README-H100-strong"}
    mean = sum(abs(mvp.run_case(c)["error_pct"]) for c in cases) / len(cases)
    assert held["summary"]["cases"] == len(cases) and abs(held["summary"]["mean_abs_pct"] - mean) < 1.0
    # no fitted constant uses a published step: every refit sees every one of its runs
    assert {x["constants"]["POWER_LIMIT_CLOCK"] for x in held["by_source"].values()} == {mvp.fit_power_limit_clock()}


def test_the_held_out_megatron_steps_are_predicted_within_eight_percent(mvp):
    """Korthikanti et al. 2022's eight A100 steps (tests/data/published_steps/korthikanti22.json), used for
    nothing but this check: every one within 8%, the mean within 5%."""
    import json

    path = Path(__file__).resolve().parents[1] / "data" / "published_steps" / "korthikanti22.json"
    cases = json.loads(path.read_text())["cases"]
    assert len(cases) == 8 and {c["pp"] for c in cases} == {1, 8, 35, 64} and {c["dp"] for c in cases} == {1}
    errs = [mvp.run_case(c)["error_pct"] for c in cases]
    assert max(map(abs, errs)) < 8.0 and sum(map(abs, errs)) / 8 < 5.0, errs


def test_mt_nlg_under_deepspeeds_schedule_costs_what_1f1b_does(mvp, published_cases):
    """The docs' claim that DeepSpeed's TrainSchedule is not MT-NLG's miss, kept true."""
    rows = mvp.deepspeed_schedule_rows([c for c in published_cases if c["source"] == "MT-NLG-530B"][:1])
    assert len(rows) == 1 and rows[0]["deepspeed_s"] == pytest.approx(rows[0]["model_1f1b_s"], rel=0.01)
    # the replay's fill and drain wait for each hop's transfer: the model's bubble now counts them too (the
    # replay was 0.1% slower before they were priced)


def test_a_published_moe_step_is_predicted_within_the_expert_target(mvp):
    """Megatron-Core's Mixtral 8x7B step (its MoE README: 468 TFLOP/s per H100 on 64 GPUs at TP 1, EP 8, PP 4,
    VP 8; tests/data/published_steps/megatron_core_moe.json), used for nothing but this check: the expert
    all-to-alls, the interleaved pipeline and the distributed optimizer through `plan`, within 15 %."""
    import json

    path = Path(__file__).resolve().parents[1] / "data" / "published_steps" / "megatron_core_moe.json"
    (case,) = json.loads(path.read_text())["cases"]
    row = mvp.run_case(case)
    assert "--ep 8" in row["command"] and "--stack megatron-core-2024" in row["command"]
    assert abs(row["error_pct"]) < 15.0, row
