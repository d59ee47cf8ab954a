"""Per-GEMM overlap choice, the engines' `choose_tp_overlap`, recommendations and cannot-help notes."""

from dataclasses import replace

import pytest

from overlapkit.costmodel import MODEL_PRESETS, ConfigError, Overlap, ParallelConfig, choose_tp_overlap, plan, preset
from overlapkit.costmodel.collectives import Collectives, Group
from overlapkit.costmodel.planner import Site, chunk_candidates, plan_site

H200 = preset("h200-sxm")


def _site(pattern="ag_gemm", m=8192, k=8192, n=1280, collective="all_gather"):
    return Site("qkv", "fwd", pattern, collective, m * 8192 * 2, m, k, n)


def test_chunk_candidates_divide_or_multiply_the_ring():
    assert chunk_candidates(8192, 8) == [2, 4, 8, 16, 32, 64]
    assert chunk_candidates(8192, 4) == [2, 4, 8, 16, 32, 64]
    assert chunk_candidates(24, 8) == [2, 4, 8]
    assert chunk_candidates(8192, 1) == [2, 4, 8, 16, 32, 64]


def test_settings_pick_within_their_modes_and_auto_takes_the_cheapest():
    coll, g = Collectives(H200), Group(8, 8)
    by = {s: plan_site(_site(), H200, coll, g, s) for s in ("none", "bulk", "pipelined", "auto")}
    assert (by["none"].mode, by["bulk"].mode) == ("none", "none")  # nothing independent to hide behind
    assert by["pipelined"].mode == "pipelined"
    assert by["auto"].time_ms == min(t for _, _, t in by["auto"].options)
    assert by["none"].time_ms == pytest.approx(by["none"].gemm_ms + by["none"].comm_ms)
    beside = plan_site(_site("beside", collective="reduce_scatter"), H200, coll, g, "bulk")
    assert beside.mode == "bulk" and beside.time_ms < beside.gemm_ms + beside.comm_ms


def test_chunk_count_is_a_per_gemm_decision():
    """QKV (N=1280) loses speed fast when chunked, FC2 does not: they get different chunk counts."""
    coll, g = Collectives(H200), Group(8, 8)
    qkv = plan_site(_site(), H200, coll, g, "auto")
    fc1 = plan_site(_site(n=7168), H200, coll, g, "auto")
    assert qkv.mode == fc1.mode == "pipelined"
    assert qkv.chunks != fc1.chunks
    # many small chunks lose: 64 chunks of 128 rows is the slowest pipelined option for QKV
    assert max(qkv.options[1:], key=lambda o: o[2])[1] == 64


def test_choose_tp_overlap_for_the_engines():
    mode, chunks = choose_tp_overlap(8192, 8192, 1280, 8, 2, "h200-sxm")
    assert mode == "pipelined" and chunks in (4, 8, 16)
    assert choose_tp_overlap(8192, 3584, 8192, 8, 2, H200, comm="reduce_scatter")[0] == "pipelined"
    assert choose_tp_overlap(128, 8192, 7168, 8, 2, H200) == ("none", 1)  # chunks of <= 64 rows lose
    assert choose_tp_overlap(8192, 8192, 7168, 8, 2, H200, comm="reduce_scatter", beside=True) == ("bulk", 1)
    assert choose_tp_overlap(8192, 8192, 7168, 1, 2, H200) == ("none", 1)
    assert choose_tp_overlap(8192, 8192, 7168, 8, 2, H200, transport="symm_mem")[0] == "pipelined"
    with pytest.raises(ConfigError, match="comm='all_reduce'"):
        choose_tp_overlap(8192, 8192, 7168, 8, 2, H200, comm="all_reduce")
    with pytest.raises(ConfigError, match="tp=16 exceeds gpus_per_node=8"):
        choose_tp_overlap(8192, 8192, 7168, 16, 2, H200)
    with pytest.raises(ConfigError, match="dtype_bytes=3"):
        choose_tp_overlap(8192, 8192, 7168, 8, 3, H200)


def test_notes_say_why_overlap_cannot_help():
    coll, g = Collectives(H200), Group(8, 8)
    small = plan_site(_site(m=128), H200, coll, g, "auto")
    assert small.mode == "none" and "m <= 64" in small.note
    heavy = plan_site(_site(), H200, coll, g, "auto")
    assert "T_comm" in heavy.note and heavy.comm_ms > heavy.gemm_ms
    ar = plan_site(_site("gemm_ar", collective="all_reduce"), H200, coll, g, "auto")
    assert ar.mode == "none" and "sequence parallelism" in ar.note


def test_recommendations_are_the_decision_table_with_savings():
    report = plan("llama3-70b", "h200-sxm", ParallelConfig(tp=8, pp=4, dp=4, global_batch=64))
    switches = [r.switch for r in report.recommendations]
    assert any(s.startswith("overlap.tp=auto") for s in switches)
    assert any(s.startswith("overlap.dp=bulk") for s in switches)
    savings = [r.saving_s for r in report.recommendations]
    assert savings == sorted(savings, reverse=True) and savings[-1] > 0
    tp_auto = next(r for r in report.recommendations if r.switch.startswith("overlap.tp=auto"))
    again = plan("llama3-70b", "h200-sxm", ParallelConfig(tp=8, pp=4, dp=4, global_batch=64, overlap=Overlap(tp="auto")))
    assert tp_auto.saving_s == pytest.approx((report.step_ms - again.step_ms) * 1e-3)
    assert "NVLink" in tp_auto.prerequisite
    assert not any(r.switch.startswith("overlap.tp") for r in again.recommendations)


def test_says_when_dp_communication_outlasts_the_backward():
    short = replace(MODEL_PRESETS["llama3-8b"], seq_len=512)  # 16 GB of gradients, a short backward
    report = plan(short, "a100-sxm-80g", ParallelConfig(dp=16, overlap=Overlap.all("auto")))
    assert any("outlasts the backward" in n for n in report.notes)
    assert report.r("dp_all_reduce") < 0.9
