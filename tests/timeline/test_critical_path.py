"""The cross-rank critical path and the what-ifs on it, on traces built so that the answer is known."""

import json

import pytest

from kineto import TraceBuilder
from overlapkit.timeline import read_traces
from overlapkit.timeline.cli import main
from overlapkit.timeline.collectives import align, clock_offsets, instances
from overlapkit.timeline.critical_path import critical_paths
from overlapkit.timeline.diagnose import analyze
from overlapkit.timeline import whatif

AR = {"Collective name": "allreduce", "In msg nelems": 1 << 20, "Out msg nelems": 1 << 20, "dtype": "Float",
      "Group size": 2, "Process Group Ranks": "[0, 1]"}


def _gpu_straggler(tmp_path, compute_us=(10_000, 20_000), skew_us=(0, 0)):
    """Two GPU ranks: compute A, then an all-reduce both must join, then compute B that waits for it.
    Rank 1's A takes 20 ms against rank 0's 10: the all-reduce starts at 20 ms for both."""
    paths = []
    end_a = max(compute_us)
    for rank, (a, skew) in enumerate(zip(compute_us, skew_us)):
        b = TraceBuilder(rank=rank)
        s = skew
        b.cpu("ProfilerStep#1", s, 40_000)
        b.launch("sm90_gemm_A", s, a, at=s)
        b.launch("ncclDevKernel_AllReduce_RING_LL(x)", s + a, end_a + 5_000 - a, at=s + 1, stream=20, **AR)
        b.launch("sm90_gemm_B", s + end_a + 5_000, 5_000, at=s + 2)
        paths.append(b.write(tmp_path / f"rank{rank}.json"))
    return paths


def test_the_path_crosses_to_the_rank_the_collective_waited_for(tmp_path):
    traces = read_traces(_gpu_straggler(tmp_path), last_step=True)
    found = instances(traces)
    (path,) = critical_paths(traces, found)
    assert path.window_ms == pytest.approx(30.0) and path.path_ms == pytest.approx(30.0)
    got = [(s.rank, s.why, round(s.ms, 3)) for s in path.segments]
    assert got == [(1, "compute", 10.0), (1, "waiting for rank 1", 10.0), (0, "exposed comm", 5.0),
                   (0, "compute", 5.0)]
    assert path.segments[1].op == "sm90_gemm_A" and path.segments[2].op.startswith("all_reduce 4.0 MiB [0, 1]")
    # rank 1 at the others' median pace: it joins at 10 ms, the step takes 20; the all-reduce hidden: 25
    assert whatif.rank_at_median([path], 1) == pytest.approx(10.0)
    assert whatif.hidden([path], "all_reduce") == pytest.approx(5.0)
    questions = {q["question"]: q["step_ms"] for q in whatif.questions([path])}
    assert questions == {"rank 1 as fast as the median of the others": pytest.approx(20.0),
                         "all_reduce fully hidden": pytest.approx(25.0)}


def test_clocks_are_aligned_on_the_collectives(tmp_path):
    # rank 1's clock runs 3 ms ahead: its all-reduce "ends" 3 ms after rank 0's; aligned, they end together
    traces = read_traces(_gpu_straggler(tmp_path, skew_us=(0, 3_000)), last_step=True)
    found = instances(traces)
    assert clock_offsets(traces, found) == {0: 0.0, 1: pytest.approx(-3.0)}
    align(traces, found)
    (path,) = critical_paths(traces, found)
    assert path.path_ms == pytest.approx(30.0)
    assert [(s.rank, s.why) for s in path.segments][:2] == [(1, "compute"), (1, "waiting for rank 1")]


def test_a_host_bound_step_is_on_the_host(tmp_path):
    # tiny kernels launched 5 ms apart by one long host op: the GPU waits for the host
    b = TraceBuilder(rank=0, world_size=1)
    b.cpu("ProfilerStep#1", 0, 11_000)
    b.cpu("aten::slow_python_loop", 0, 10_050, cat="cpu_op")
    for at in (0, 5_000, 10_000):
        b.launch("tiny_kernel", at + 10, 10, at=at)
    traces = read_traces([b.write(tmp_path / "t.json")], last_step=True)
    (path,) = critical_paths(traces, instances(traces))
    assert path.path_ms == pytest.approx(path.window_ms) == pytest.approx(10.01)
    assert path.ms_by("host launch gap") == pytest.approx(10.0, abs=0.01)
    assert {s.op for s in path.segments if s.why == "host launch gap"} == {"aten::slow_python_loop"}
    # without the gaps the step is its three 10 µs kernels: never shorter than the GPU's own work
    assert path.busy_ms == pytest.approx(0.03)
    assert whatif.launch_gaps([path]) == pytest.approx(path.path_ms - 0.03)


def test_cuda_graph_kernels_are_one_stretch_of_their_graph(tmp_path):
    b = TraceBuilder(rank=0, world_size=1)
    b.cpu("ProfilerStep#1", 0, 2_000)
    b.events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "pid": 10, "tid": 1, "ts": 0,
                     "dur": 20, "args": {"correlation": 77}})
    for k, ts in enumerate((100, 400, 700)):
        b.events.append({"ph": "X", "cat": "kernel", "name": f"graph_kernel_{k}", "pid": 0, "tid": 7, "ts": ts,
                         "dur": 300, "args": {"stream": 7, "device": 0, "correlation": 77}})
    t = read_traces([b.write(tmp_path / "g.json")], last_step=True)
    assert any("replayed by CUDA graphs" in n for n in t[0].notes)
    assert all(s.step == 1 for s in t[0].spans)  # tied to the graph's launch, so inside the step
    (path,) = critical_paths(t, instances(t))
    (graph,) = [s for s in path.segments if s.why == "compute"]
    assert graph.op == "CUDA graph launched at -0.100 ms"  # the axis starts at the first kernel
    assert graph.ms == pytest.approx(0.9)


def _cpu_rank(tmp_path, rank, compute_us):
    """A gloo rank: compute, issue an all-reduce, wait for it (its worker thread runs it), compute again."""
    b = TraceBuilder(rank=rank)
    c = compute_us
    b.cpu("ProfilerStep#1", 0, 40_000)
    b.cpu("aten::mm", 0, c, cat="cpu_op")
    b.cpu("c10d::allreduce_", c, 100, cat="cpu_op")
    b.cpu("gloo:all_reduce", c + 100, 25_000 - c - 100, tid=9, **{"Input Dims": [[1024]], "Input type": ["float"]})
    b.cpu("c10d::wait", c + 200, 25_100 - c - 200, cat="cpu_op")
    b.cpu("aten::add_", 25_100, 4_900, cat="cpu_op")
    doc = b.doc()
    doc["distributedInfo"]["backend"] = "gloo"
    path = tmp_path / f"cpu{rank}.json"
    path.write_text(json.dumps(doc))
    return path


def test_a_gloo_straggler_is_on_the_path_and_its_median_what_if(tmp_path, capsys):
    paths = [_cpu_rank(tmp_path, 0, 10_000), _cpu_rank(tmp_path, 1, 20_000)]
    traces = read_traces(paths, last_step=True)
    assert all(t.device == "cpu" for t in traces)
    (path,) = critical_paths(traces, instances(traces))
    assert path.path_ms == pytest.approx(path.window_ms) == pytest.approx(30.0)
    by = {w: round(path.ms_by(w), 3) for w in ("compute", "waiting for rank 1", "exposed comm", "idle")}
    # rank 1 computes 20 ms, the last 9.9 of it (and its 0.1 ms issue) after rank 0 was ready: 10 ms waited for
    assert by == {"compute": 15.1, "waiting for rank 1": 10.0, "exposed comm": 4.9, "idle": 0.0}
    assert path.segments[0].op == "aten::mm" and path.segments[0].rank == 1
    assert whatif.rank_at_median([path], 1) == pytest.approx(10.0)
    # the same through the command line's --json
    assert main([str(p) for p in paths] + ["--json", "--last-step", "--what-if", "rank=1", "hide=all_reduce"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"rank", "op", "ms", "why"} <= set(doc["critical_path"][0])
    assert sum(s["ms"] for s in doc["critical_path"]) == pytest.approx(30.0)
    asked = {q["question"]: q["step_ms"] for q in doc["what_if_asked"]}
    assert asked == {"rank 1 as fast as the median of the others": pytest.approx(20.0),
                     "all_reduce fully hidden": pytest.approx(25.1)}


def test_a_bad_what_if_is_one_line(tmp_path, capsys):
    assert main([str(p) for p in _gpu_straggler(tmp_path)] + ["--what-if", "faster=yes"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--what-if 'faster=yes'" in err and err.count("\n") == 0
    assert main([str(p) for p in _gpu_straggler(tmp_path)] + ["--what-if", "overlap=pipelined"]) == 2
    assert "needs --config" in capsys.readouterr().err


def test_analysis_carries_the_paths_and_offsets(tmp_path):
    a = analyze(read_traces(_gpu_straggler(tmp_path, skew_us=(0, 1_000)), last_step=True))
    assert a.clock_offsets[1] == pytest.approx(-1.0) and len(a.paths) == 1
    assert a.what_if[0]["question"] == "rank 1 as fast as the median of the others"


def test_a_copy_engine_transfer_the_gemm_waited_for_is_on_the_path(tmp_path):
    # overlapkit's symmetric-memory pull: a peer copy issued inside overlapkit.comm.tp_all_gather on its
    # own stream; the GEMM that needs it waits (an event) and starts as it lands
    b = TraceBuilder(rank=0, world_size=1)
    b.cpu("ProfilerStep#1", 0, 2_000)
    b.cpu("overlapkit.comm.tp_all_gather:fc1", 0, 20)
    b.launch("Memcpy PtoP (Device -> Device)", 10, 800, at=5, stream=30, cat="gpu_memcpy", bytes=1 << 20)
    b.launch("sm90_gemm_fc1", 820, 300, at=30)
    traces = read_traces([b.write(tmp_path / "t.json")], last_step=True)
    (path,) = critical_paths(traces, instances(traces))
    assert [(s.why, s.kind) for s in path.segments] == [("exposed comm", "tp_all_gather"), ("compute", "compute")]
    assert path.segments[0].op.startswith("tp_all_gather 1.0 MiB") and path.path_ms == pytest.approx(1.11)
