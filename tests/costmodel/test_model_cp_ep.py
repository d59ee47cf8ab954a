"""Context-parallel schedules and MoE chunks priced one by one, and against the committed 16-core runs
(benchmarks/model_vs_measured.py --ep-cp reads benchmarks/results; nothing is timed here)."""

from pathlib import Path

import pytest

from overlapkit.costmodel import ModelConfig, Overlap, ParallelConfig, predict, preset
from overlapkit.costmodel.overlap import cp_pass_ms

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
H100 = preset("h100-sxm")
L8 = ModelConfig(hidden=4096, ffn_hidden=14336, num_layers=4, num_heads=32, num_kv_heads=8, seq_len=32768,
                 vocab_size=128256)


def test_each_cp_schedule_has_its_own_price():
    block, kv, dkv = 2.0, 1.0, 1.5
    # none: every hop in the open; forward: 3 K/V hops, backward: 2 (step 1's block kept) + 3 dK/dV
    assert cp_pass_ms("none", "fwd", block, kv, dkv, 4, 1.0) == pytest.approx(4 * block + 3 * kv)
    assert cp_pass_ms("none", "bwd", block, kv, dkv, 4, 1.0) == pytest.approx(4 * block + 2 * kv + 3 * dkv)
    # forward: the ring and the all-gather both hide hops shorter than a block
    assert cp_pass_ms("pipelined", "fwd", block, kv, dkv, 4, 1.0) == pytest.approx(4 * block)
    assert cp_pass_ms("bulk", "fwd", block, kv, dkv, 4, 1.0) == pytest.approx(4 * block)
    # backward: the ring's last dK/dV hop goes home after the last block; bulk's travels behind the own block
    # (and on the one transfer stream its K/V hop queues behind the dK/dV hop before it: half a ms more)
    assert cp_pass_ms("pipelined", "bwd", block, kv, dkv, 4, 1.0) == pytest.approx(4 * block + dkv + 0.5)
    assert cp_pass_ms("bulk", "bwd", block, kv, dkv, 4, 1.0) == pytest.approx(4 * block)
    # hops longer than a block: the ring waits for each one, the all-gather posted them all at the start
    assert cp_pass_ms("pipelined", "fwd", 1.0, 3.0, 0.0, 4, 1.0) == pytest.approx(3 * 3.0 + 1.0)
    with pytest.raises(ValueError, match="schedule='ring'"):
        cp_pass_ms("ring", "fwd", block, kv, dkv, 4, 1.0)


def test_plan_prices_bulk_ring_and_none_apart_and_auto_keeps_the_fastest():
    r = {m: predict(L8, ParallelConfig(cp=4, overlap=Overlap(cp=m)), H100) for m in ("none", "pipelined", "bulk", "auto")}
    exposed = {m: x.exposed_by_kind["cp_kv"] for m, x in r.items()}
    assert exposed["none"] == pytest.approx(r["none"].comm_by_kind["cp_kv"])
    assert exposed["bulk"] < exposed["pipelined"] < exposed["none"]
    assert exposed["auto"] == pytest.approx(exposed["bulk"])
    assert len({x.comm_by_kind["cp_kv"] for x in r.values()}) == 1  # the same bytes, moved differently


def test_moe_chunks_pay_a_latency_per_chunk():
    moe = ModelConfig(hidden=2048, ffn_hidden=1024, num_layers=2, num_heads=16, seq_len=4096, vocab_size=32000,
                      num_experts=8, top_k=2)
    r = {c: predict(moe, ParallelConfig(dp=8, ep=8, moe_chunks=c, overlap=Overlap(ep="pipelined")), H100)
         for c in (1, 2, 4, 8, 64)}
    comm = [r[c].comm_by_kind["ep_all_to_all"] for c in sorted(r)]
    assert comm == sorted(comm) and comm[-1] > comm[0]
    assert r[2].exposed_by_kind["ep_all_to_all"] < r[1].exposed_by_kind["ep_all_to_all"]
    assert r[64].step_ms > min(x.step_ms for x in r.values())  # too many chunks cost more than they hide


@pytest.mark.skipif(not list(RESULTS.glob("cp_overlap_cpu16*.json")), reason="no committed 16-core CP runs")
def test_cp_schedules_against_the_measured_16_core_runs(cpu16):
    """Calibrated from each run's ring trace: none and bulk, forward and forward+backward. The two misses are
    `none` at world 4, 3 threads (a late peer's wait that the balanced model does not see: cp_waits)."""
    rows = cpu16.cp_rows(RESULTS)
    assert len(rows) == 12 and {r["variant"] for r in rows} == {"none", "bulk"}
    errs = [abs(r["error_pct"]) for r in rows]
    assert sum(e <= cpu16.TARGET_PCT for e in errs) >= 10 and max(errs) < 17.0
    assert all(abs(r["error_pct"]) <= 5.0 for r in rows if r["variant"] == "bulk")


@pytest.mark.skipif(not list(RESULTS.glob("ep_overlap_cpu16*.json")), reason="no committed 16-core EP runs")
def test_ep_chunks_against_the_measured_16_core_runs(cpu16):
    """Calibrated from each run's one- and two-chunk traces: 4 and 8 chunks. The misses are world 4's 4 chunks
    of 2026-12-02 (measured 57% slower than 2 chunks where 8 chunks are only 1% slower than 4) and 8 chunks of
    the 2026-12-07 lane run, whose 2-chunk step was faster than its 1-chunk one: the per-chunk growth read
    off those two is then no growth, and 8 chunks are priced from noise (+41%)."""
    rows = cpu16.ep_rows(RESULTS)
    assert len(rows) == 6
    missed = sorted((r["run"], r["variant"]) for r in rows if abs(r["error_pct"]) > cpu16.TARGET_PCT)
    assert missed == [("ep_overlap_cpu16_ws4", "chunks=4"), ("ep_overlap_cpu16_ws4_lane13", "chunks=8")], rows
    assert all(abs(r["error_pct"]) < 45.0 for r in rows)
