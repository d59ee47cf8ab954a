"""Bandwidth, stragglers, slow groups and the diagnosis walk: formulas by hand, and on real traces."""

import gzip
import json
import statistics
from pathlib import Path

import pytest

from overlapkit.timeline import Span, read_traces
from overlapkit.analyze_tool import hardware_links as hardware_for
from overlapkit.analyze_tool import main
from overlapkit.timeline.bandwidth import bandwidth_rows, bus_factor
from overlapkit.timeline.diagnose import analyze, walk
from overlapkit.timeline.ranks import rank_waits, slow_groups, stragglers
from overlapkit.timeline.trace import Trace

DATA = Path(__file__).resolve().parents[1] / "data" / "timeline"
CHECKS = ["compute saturated", "communication share of the step", "which collectives", "already overlapped",
          "topology and grouping", "critical path", "what to change"]


def _comm(a, b, kind="all_reduce", nbytes=0, n=8, rank=0, group="", step=0, phase="backward"):
    return Span(kind, "k", "stream 20", a, b, rank=rank, nbytes=nbytes, group_size=n, step=step, phase=phase,
                group=group)


def _trace(rank, spans):
    return Trace(path=f"r{rank}.json", rank=rank, world_size=None, spans=spans, origin_unix_ms=0.0, steps=[0],
                 dropped_step=None, device="gpu")


def test_nccl_tests_bus_factors():
    assert bus_factor("all_reduce", 8) == pytest.approx(1.75)
    assert bus_factor("all_gather", 4) == bus_factor("reduce_scatter", 4) == bus_factor("all_to_all", 4) == 0.75
    assert bus_factor("broadcast", 8) == bus_factor("send_recv", 2) == 1.0


def test_bandwidth_and_bound_against_the_h200_preset():
    hw = hardware_for("NVIDIA H200")  # the trace's GPU name picks the cost model's preset
    assert hw.name == "h200-sxm"
    # 100 MB all-reduce over 8 ranks in 1 ms: algbw 100 GB/s, busbw 175 GB/s, 38.9 % of NVLink's 450;
    # latency 14 steps x 2 µs = 28 µs < bytes 100e6 x 1.75 / 450e9 = 389 µs: bandwidth-bound
    # 4 KiB in 0.03 ms: bytes 4096 x 1.75 / 450e3 = 0.016 µs < 28 µs: latency-bound
    rows = bandwidth_rows(0, [_comm(0, 1, nbytes=100_000_000), _comm(2, 2.03, nbytes=4096)], hw)
    big, small = sorted(rows, key=lambda r: -r.nbytes)
    assert (big.algbw_gbps, big.busbw_gbps) == (pytest.approx(100.0), pytest.approx(175.0))
    assert big.pct_of_peak == pytest.approx(175 / 450 * 100) and big.bound == "bandwidth"
    assert small.bound == "latency" and "NVLink" in small.link
    # 16 ranks do not fit in one 8-GPU node: the network link (InfiniBand, 50 GB/s)
    (net,) = bandwidth_rows(0, [_comm(0, 1, nbytes=100_000_000, n=16)], hw)
    assert net.peak_gbps == 50.0 and "InfiniBand" in net.link
    # unknown hardware: no peak, no bound; --peak-gbps gives both
    (bare,) = bandwidth_rows(0, [_comm(0, 1, nbytes=100_000_000)])
    assert bare.peak_gbps is None and bare.bound is None and bare.busbw_gbps == pytest.approx(175.0)
    (flag,) = bandwidth_rows(0, [_comm(0, 1, nbytes=100_000_000)], peak_gbps=200.0)
    assert flag.pct_of_peak == pytest.approx(87.5) and flag.bound == "bandwidth"


def test_the_rank_that_arrives_last_is_the_straggler():
    # three all-reduces per rank; rank 2 arrives 4 ms late each time, so ranks 0 and 1 wait 4 ms
    # in each (their kernels last 5 ms, rank 2's 1 ms): wait 12 ms, 12 ms, 0 ms over one step
    traces = [_trace(r, [_comm(10 * i + (0 if r < 2 else 4), 10 * i + 5, rank=r) for i in range(3)]) for r in range(3)]
    waits = rank_waits(traces, {0: 1, 1: 1, 2: 1})
    assert waits == {0: pytest.approx(12.0), 1: pytest.approx(12.0), 2: pytest.approx(0.0)}
    assert stragglers(waits, {0: 30.0, 1: 30.0, 2: 30.0}) == [{"rank": 2, "behind_ms": pytest.approx(12.0)}]
    assert stragglers({0: 1.0, 1: 1.01}, {0: 30.0, 1: 30.0}) == []  # noise is nobody's fault


def test_a_group_far_slower_than_its_peers_is_flagged():
    # two TP groups all-reduce 64 MB over 2 ranks: [0, 1] in 1 ms, [2, 3] in 4 ms (busbw 64 vs 16 GB/s)
    traces = [_trace(r, [_comm(0, 1 if r < 2 else 4, nbytes=64_000_000, n=2, rank=r,
                               group="[0, 1]" if r < 2 else "[2, 3]")]) for r in range(4)]
    (slow,) = slow_groups(traces)
    assert slow["group"] == "[2, 3]" and slow["busbw_gbps"] == pytest.approx(16.0)
    assert slow["peers_median_gbps"] == pytest.approx(64.0)


def _kernel_waits(path):
    """Independent count on one DLRM rank: durations of its all-reduce kernels, in order."""
    ev = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    return [e["dur"] / 1e3 for e in sorted(ev, key=lambda e: e["ts"]) if e.get("cat") == "kernel"
            and e["name"].startswith("ncclKernel_AllReduce")]


def test_dlrm_8_ranks_stragglers_from_the_trace():
    # param's 8-rank DLRM step: each rank runs 3 all-reduce kernels; the wait of a rank in one is
    # its duration minus the shortest of the 8, summed (one step per trace).
    files = sorted((DATA / "dlrm_8ranks").glob("*.json.gz"))
    durations = [_kernel_waits(f) for f in files]
    assert all(len(d) == 3 for d in durations)
    expected = [sum(d[i] - min(x[i] for x in durations) for i in range(3)) for d in durations]
    a = analyze(read_traces([DATA / "dlrm_8ranks"]))
    assert [a.waits[r] for r in range(8)] == pytest.approx(expected, abs=1e-9)
    # ranks 4 and 5 waited ~0.06 and 0.02 ms, the others 1.2-1.7 ms: the others waited for them
    assert [s["rank"] for s in a.stragglers] == [5, 4]
    # behind = median of the other ranks' waits - its own wait
    assert a.stragglers[0]["behind_ms"] == pytest.approx(statistics.median(expected[:5] + expected[6:]) - expected[5])
    # HTA 0.5.0's overlap on the same ranks (corpus hta_reference.json): within 0.01 points
    hta = [4.5, 2.47, 7.88, 3.31, 0.56, 0.64, 7.56, 9.51]
    assert [r.total.overlap_pct for r in a.report.ranks] == pytest.approx(hta, abs=0.01)
    checks = walk(a)
    assert [c["check"] for c in checks] == CHECKS
    assert checks[4]["verdict"] == "mismatch" and "rank 5 is 1.54 ms/step behind" in checks[4]["evidence"]


def test_diagnose_json_on_plain_ddp(capsys):
    # plain gloo DDP, 2 ranks: backward all-reduces, 74.5 / 80 % hidden; no link peak on CPU
    assert main([str(DATA / "gloo_ddp_rank0.json.gz"), str(DATA / "gloo_ddp_rank1.json.gz"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [d["check"] for d in doc["diagnosis"]] == CHECKS
    assert all(set(d) == {"check", "verdict", "evidence", "try"} for d in doc["diagnosis"])
    assert all(set(s) == {"rank", "behind_ms"} for s in doc["stragglers"])
    which = doc["diagnosis"][2]
    assert which["verdict"] == "backward all_reduce" and "data parallel" in which["try"]
    assert doc["diagnosis"][3]["verdict"] == "partly"
    assert {r["phase"] for r in doc["exposed_by_phase"]} == {"backward"}
    # profiled without record_shapes: no message size, so no bandwidth (and no peak on CPU)
    assert all(b["nbytes"] == 0 and b["busbw_gbps"] is None and b["peak_gbps"] is None for b in doc["bandwidth"])


def test_gloo_message_sizes_come_from_the_recorded_shapes():
    # HTA's gloo trace records shapes: all-reduces of [321271] and [2082411] floats over 300 ranks
    a = analyze(read_traces([DATA / "hta_cpu_only_rank34.json.gz"]), peak_gbps=10.0)
    sizes = {(b.nbytes, b.group_size, b.count) for b in a.bandwidth}
    assert sizes == {(321271 * 4, 300, 5), (2082411 * 4, 300, 5)}
    big = max(a.bandwidth, key=lambda b: b.nbytes)
    assert big.busbw_gbps == pytest.approx(2082411 * 4 / (big.median_ms * 1e6) * 2 * 299 / 300)


def test_diagnose_text_with_a_stated_configuration(capsys):
    args = [str(DATA / "gloo_ddp_rank0.json.gz"), str(DATA / "gloo_ddp_rank1.json.gz"), "--diagnose", "--brief",
            "--config", "model=llama3-8b", "tp=1", "dp=2", "overlap=none"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Diagnosis" in out and "7. what to change" in out and "seed" not in out
    assert "overlapkit plan on the stated configuration predicts" in out and "overlap.dp=bulk" in out
    assert main(args[:-3] + ["tp=x"]) == 2
    assert "config tp='x': expected an integer" in capsys.readouterr().err


def test_unknown_compute_stops_the_walk_at_the_first_check():
    a = analyze(read_traces([DATA / "hta_cpu_only_rank34.json.gz"]))
    (only,) = walk(a)
    assert only["check"] == "compute saturated" and only["verdict"] == "unknown"


def test_two_groups_of_one_kind_are_not_taken_for_one():
    # TP groups {0, 1} and {2, 3} all-gather at different times on one clock, no group named: rank 1
    # waits 2 ms for rank 0, rank 3 waits 1 ms for rank 2; across groups nobody waits for anybody
    spans = {0: (0, 1), 1: (-2, 1), 2: (10, 11), 3: (9, 11)}
    traces = [_trace(r, [_comm(a, b, kind="tp_all_gather", n=0, rank=r)]) for r, (a, b) in spans.items()]
    assert rank_waits(traces, {}) == {0: 0.0, 1: pytest.approx(2.0), 2: 0.0, 3: pytest.approx(1.0)}


def test_a_cost_model_what_if_on_the_measured_path(capsys):
    # the stated job (DP=2, no overlap) against overlap.dp=bulk: the model's share of the DP all-reduce's
    # exposed time that the change hides, applied to the all-reduce's exposed time on the measured path
    from overlapkit.costmodel import ParallelConfig, Overlap, load_hardware, load_model, predict
    from overlapkit.timeline import whatif

    args = [str(DATA / "gloo_ddp_rank0.json.gz"), str(DATA / "gloo_ddp_rank1.json.gz"), "--json",
            "--config", "model=llama3-8b", "tp=1", "dp=2", "overlap=none", "--what-if", "overlap.dp=bulk"]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    (asked,) = doc["what_if_asked"]
    model, hw = load_model("llama3-8b"), load_hardware("h200-sxm")
    base = predict(model, ParallelConfig(tp=1, dp=2), hw)
    alt = predict(model, ParallelConfig(tp=1, dp=2, overlap=Overlap(dp="bulk")), hw)
    share = 1 - alt.exposed_by_kind["dp_all_reduce"] / base.exposed_by_kind["dp_all_reduce"]
    assert 0 < share <= 1 and asked["hidden_share"]["dp_all_reduce"] == pytest.approx(share)
    on_path = statistics.mean(sum(s["ms"] for s in doc["critical_path"] if s["step"] == p["step"]
                                  and s["why"] == "exposed comm" and s["kind"] == "all_reduce")
                              for p in doc["critical_paths"])
    assert asked["saving_ms"] == pytest.approx(share * on_path, rel=1e-6) and asked["saving_ms"] > 0
    assert asked["step_ms"] == pytest.approx(asked["measured_ms"] - asked["saving_ms"])
    assert whatif.base_kind("dp_all_reduce") == "all_reduce"
    assert main(args[:-1] + ["overlap.xx=bulk"]) == 2
    assert "ENGINE one of" in capsys.readouterr().err
