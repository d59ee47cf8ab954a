"""The trace reader sees torch's plain FSDP2: its collectives are zero_all_gather / zero_reduce_scatter,
named by module, its copy-in/chunk-cat work stays compute, and `analyze` says per module what hid."""

import json
import os
import tempfile

import pytest

from distributed import distributed
from fsdp2_trace import LATE_S
from kineto import TraceBuilder
from overlapkit.timeline import read_trace, read_traces
from overlapkit.timeline.cli import main
from overlapkit.timeline.fsdp2 import fsdp2_comm, layer_report

DATA = os.path.join(os.path.dirname(__file__), "..", "data")
MODULES = ["(root)", "layers.0", "layers.1", "layers.2"]


def test_range_names_give_kind_module_and_phase():
    fwd = ["FSDP::all_gather (layers.3)", "FSDP::pre_forward (layers.3)"]
    assert fsdp2_comm(fwd, "all_gather") == ("zero_all_gather", "layers.3 forward")
    bwd = ["FSDP::all_gather (layers.2) [pg=2]", "FSDP::backward_prefetch for layers.2", "FSDP::pre_backward (layers.3)"]
    assert fsdp2_comm(bwd, "all_gather") == ("zero_all_gather", "layers.2 backward")
    assert fsdp2_comm(["FSDP::all_gather", "FSDP::root_pre_forward"], "all_gather") == ("zero_all_gather",
                                                                                       "(root) forward")
    red = ["FSDP::post_backward_reduce (blocks.1)", "FSDP::root_post_backward_callback"]
    assert fsdp2_comm(red, "reduce_scatter") == ("zero_reduce_scatter", "blocks.1")
    assert fsdp2_comm(red, "all_reduce") == ("dp_all_reduce", "blocks.1")  # HSDP's replica all-reduce
    assert fsdp2_comm(["FSDP::pre_forward (a)"], "all_gather") is None  # not a collective range
    assert fsdp2_comm(["FSDP::all_gather (a)"], "all_to_all") is None


def _gpu_fsdp2_trace(tmp_path):
    """Host thread 1 runs FSDP2's hooks; stream 7 computes, 20 gathers, 21 reduce-scatters (µs)."""
    b = TraceBuilder()
    b.cpu("FSDP::root_pre_forward", 0, 5)
    b.cpu("FSDP::all_gather", 1, 3)
    b.launch("void at::native::all_gather_copy_in_kernel<float>", 10, 2, at=1.5)
    b.launch("ncclDevKernel_AllGather_RING_LL(ncclDevComm*)", 12, 10, at=2, stream=20)
    b.cpu("FSDP::pre_forward (layers.0)", 5, 5)
    b.cpu("FSDP::all_gather (layers.0) [pg=2]", 6, 3)
    b.launch("ncclDevKernel_AllGather_RING_LL(ncclDevComm*)", 22, 10, at=7, stream=20)
    b.launch("gemm_forward", 25, 15, at=11)
    b.launch("gemm_backward", 55, 20, at=49)
    b.cpu("FSDP::pre_backward (layers.1)", 50, 10)
    b.cpu("FSDP::backward_prefetch for layers.0", 52, 6)
    b.cpu("FSDP::all_gather (layers.0)", 53, 4)
    b.launch("ncclDevKernel_AllGather_RING_LL(ncclDevComm*)", 60, 10, at=54, stream=20)
    b.cpu("FSDP::post_backward_reduce (layers.1)", 80, 10)
    b.launch("void at::native::chunk_cat_cuda_kernel<float>", 90, 2, at=81, stream=21)
    b.launch("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevComm*)", 92, 10, at=82, stream=21)
    b.launch("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*)", 102, 2, at=83, stream=21)
    b.launch("ncclDevKernel_AllGather_RING_LL(ncclDevComm*)", 110, 5, at=110, stream=20)  # not FSDP2's
    return b.write(tmp_path / "fsdp2_gpu.json")


def test_gpu_trace_labels_only_fsdp2s_collective_kernels(tmp_path):
    t = read_trace(_gpu_fsdp2_trace(tmp_path))
    got = [(s.kind, s.name, s.start_ms * 1e3) for s in t.spans]
    comm = [(k, n) for k, n, _ in got if k != "compute"]
    assert comm == [("zero_all_gather", "(root) forward"), ("zero_all_gather", "layers.0 forward"),
                    ("zero_all_gather", "layers.0 backward"), ("zero_reduce_scatter", "layers.1"),
                    ("dp_all_reduce", "layers.1"), ("all_gather", "ncclDevKernel_AllGather_RING_LL(ncclDevComm*)")]
    compute = {n for k, n, _ in got if k == "compute"}
    assert any("copy_in" in n for n in compute) and any("chunk_cat" in n for n in compute)
    rows = {r.name: r for r in layer_report(t.spans)}
    assert list(rows) == ["(root)", "layers.0", "layers.1"]
    ms = 1e-3
    assert rows["(root)"].forward_gather_exposed_ms == pytest.approx(10 * ms)  # nothing computes at 12-22
    assert rows["layers.0"].forward_gather_ms == pytest.approx(10 * ms)
    assert rows["layers.0"].forward_gather_exposed_ms == pytest.approx(3 * ms)  # gemm covers 25-32 of 22-32
    assert rows["layers.0"].backward_gather_exposed_ms == pytest.approx(0.0)  # under the backward gemm
    assert rows["layers.1"].reduce_scatter_ms == pytest.approx(10 * ms)
    assert rows["layers.1"].hidden_pct == pytest.approx(0.0)


def test_analyze_prints_and_emits_the_per_module_table(tmp_path, capsys):
    path = str(_gpu_fsdp2_trace(tmp_path))
    assert main([path, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["zero3_layers"]
    assert [(r["rank"], r["name"]) for r in rows] == [(0, "(root)"), (0, "layers.0"), (0, "layers.1")]
    assert rows[1]["forward_gather_exposed_ms"] == pytest.approx(0.003) and rows[1]["hidden_pct"] == pytest.approx(85.0)
    assert main([path]) == 0
    out = capsys.readouterr().out
    assert "ZeRO-3 / FSDP2 per module" in out and "layers.0" in out


def _check_plain_fsdp2(traces) -> None:
    """What plain FSDP2 on gloo must read as: 4 forward gathers, 3 backward re-gathers (the root keeps
    its parameters), 4 reduce-scatters, none hidden (on CPU FSDP2 waits for each collective on the host)."""
    for t in traces:
        kinds = {s.kind for s in t.spans if s.is_comm}
        assert kinds == {"zero_all_gather", "zero_reduce_scatter"}, kinds  # gloo runs FSDP2's RS as all_reduce
        names = sorted(s.name for s in t.spans if s.kind == "zero_all_gather")
        assert names == sorted([f"{m} forward" for m in MODULES] + [f"{m} backward" for m in MODULES[1:]])
        assert sorted(s.name for s in t.spans if s.kind == "zero_reduce_scatter") == MODULES
        rows = layer_report(t.spans)
        assert [r.name for r in rows] == MODULES
        for r in rows:
            assert r.comm_ms > 0 and r.exposed_ms >= 0.95 * r.comm_ms, r


def test_committed_plain_fsdp2_gloo_trace():
    traces = read_traces([os.path.join(DATA, f"fsdp2_gloo_rank{r}.json.gz") for r in (0, 1)])
    assert [t.rank for t in traces] == [0, 1] and all(t.device == "cpu" and t.compute_known for t in traces)
    _check_plain_fsdp2(traces)


@distributed(world_size=2, timeout_s=60.0)
def _record_both(trace_dir: str):
    from fsdp2_trace import record

    return (record(f"{trace_dir}/plain_rank{{rank}}.json"), record(f"{trace_dir}/ours_rank{{rank}}.json", ours=True))


def test_fresh_traces_of_plain_fsdp2_and_of_prefetching_fully_shard():
    """Recorded on the torch that runs the test (its FSDP2 range names). With overlapkit's prefetch 1,
    rank 0 issues layers.1's gather in layers.0's pre-forward; rank 1 joins it LATE_S later, and
    all that while rank 0 computes layers.0 and its pause: the reader must see that gather hidden."""
    with tempfile.TemporaryDirectory() as d:
        paths = _record_both(d)
        plain = read_traces([p for p, _ in paths])
        ours = read_traces([p for _, p in paths])
    _check_plain_fsdp2(plain)
    rows = [{r.name: r for r in layer_report(t.spans)} for t in ours]
    assert [list(r) for r in rows] == [MODULES, MODULES]
    r = rows[0]["layers.1"]
    assert r.forward_gather_ms > 0.5 * LATE_S * 1e3 and r.forward_gather_exposed_ms < 0.2 * r.forward_gather_ms, r
