"""The trace reader on small traces built to test one rule each."""

import pytest

from kineto import TraceBuilder
from overlapkit.timeline import read_trace, read_traces, report_traces
from overlapkit.timeline.trace import collective_kind


def test_collective_names_normalize():
    for raw, kind in [("allreduce", "all_reduce"), ("_allgather_base", "all_gather"), ("AllGather", "all_gather"),
                      ("reduce_scatter_tensor_coalesced", "reduce_scatter"), ("ReduceScatter", "reduce_scatter"),
                      ("SendRecv", "send_recv"), ("gloo:all_to_all", "all_to_all"), ("Generic", "nccl"),
                      ("broadcast", "broadcast")]:
        assert collective_kind(raw) == kind, raw


def test_nccl_kernels_and_their_metadata(tmp_path):
    b = TraceBuilder()
    b.launch("ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", 100, 50, at=90,
             stream=20, **{"Collective name": "allgather", "In msg nelems": 256, "Out msg nelems": 512,
                           "dtype": "BFloat16", "Group size": 2})
    # metadata on the record_param_comms op with the kernel's External id
    b.cpu("record_param_comms", 195, 10, cat="cpu_op", **{"External id": 7, "Collective name": "reduce_scatter",
                                                           "In msg nelems": 1024, "Out msg nelems": 256,
                                                           "dtype": "Float", "Group size": 4})
    b.launch("ncclKernel_ReduceScatter_RING_LL_Sum_float(ncclWorkElem)", 200, 30, at=200, stream=20,
             **{"External id": 7})
    # metadata on the record_param_comms op around the launch
    b.cpu("record_param_comms", 295, 10, cat="cpu_op", tid=2, **{"External id": 8, "Collective name": "allreduce",
                                                                  "In msg nelems": 10, "dtype": "Half", "Group size": 8})
    b.launch("ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)", 300, 20, at=300, tid=2, stream=20)
    b.launch("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)", 400, 10,
             at=390, stream=21)
    b.launch("rcclGenericKernel_x", 420, 5, at=415, stream=21)
    b.launch("ampere_sgemm_128x64_nn", 100, 300, at=80)
    b.launch("Memcpy DtoD (Device -> Device)", 500, 5, at=490, cat="gpu_memcpy", bytes=64)
    b.launch("Memset (Device)", 510, 5, at=505, cat="gpu_memset", bytes=64)
    t = read_trace(b.write(tmp_path / "t.json"))
    got = [(s.kind, s.nbytes, s.group_size, s.stream) for s in t.spans]
    assert got == [("all_gather", 1024, 2, "stream 20"), ("compute", 0, 0, "stream 7"),
                   ("reduce_scatter", 4096, 4, "stream 20"), ("all_reduce", 20, 8, "stream 20"),
                   ("send_recv", 0, 0, "stream 21"), ("nccl", 0, 0, "stream 21"),
                   ("memcpy", 64, 0, "stream 7"), ("memset", 64, 0, "stream 7")]
    assert t.spans[0].start_ms == 0 and t.spans[0].end_ms == pytest.approx(0.05)
    assert t.origin_unix_ms == pytest.approx(1.7e12 + 0.1)  # base + the first span's start
    assert (t.rank, t.world_size, t.device) == (0, 2, "gpu")


def test_overlapkit_ranges_name_copies_and_computations(tmp_path):
    b = TraceBuilder()
    b.cpu("overlapkit.comm.tp_all_gather:fc1", 10, 20)
    b.launch("Memcpy PtoP (Device -> Device)", 40, 100, at=15, stream=30, cat="gpu_memcpy", bytes=4096)
    b.cpu("overlapkit.compute.fc1.fwd", 35, 20)
    b.launch("sm90_xmma_gemm_bf16", 45, 80, at=40)
    b.launch("Memcpy DtoD (Device -> Device)", 200, 10, at=60, stream=30, cat="gpu_memcpy", bytes=8)
    spans = read_trace(b.write(tmp_path / "t.json")).spans
    assert [(s.kind, s.name, s.nbytes) for s in spans] == [
        ("tp_all_gather", "Memcpy PtoP (Device -> Device)", 4096), ("compute", "fc1.fwd", 0),
        ("memcpy", "Memcpy DtoD (Device -> Device)", 8)]
    report = report_traces([read_trace(tmp_path / "t.json")])
    assert report.ranks[0].total.hidden_ms == pytest.approx(0.08)  # the GEMM covers 80 of the copy's 100 µs


def _two_steps(tmp_path):
    b = TraceBuilder()
    b.cpu("ProfilerStep#3", 0, 100)
    b.cpu("ProfilerStep#4", 100, 100)
    b.launch("gemm_a", 10, 20, at=5)
    b.launch("gemm_b", 120, 20, at=95)  # launched in step 3, runs during step 4's CPU range
    b.launch("gemm_c", 150, 20, at=110)
    return b.write(tmp_path / "steps.json", gz=True)


def test_steps_come_from_the_launch_and_the_last_one_is_dropped(tmp_path):
    path = _two_steps(tmp_path)
    t = read_trace(path)
    assert [(s.name, s.step) for s in t.spans] == [("gemm_a", 3), ("gemm_b", 3)]
    assert t.steps == [3] and t.dropped_step == 4
    kept = read_trace(path, last_step=True)
    assert [(s.name, s.step) for s in kept.spans] == [("gemm_a", 3), ("gemm_b", 3), ("gemm_c", 4)]
    assert kept.dropped_step is None


def test_ranks_of_one_job_share_a_time_axis_and_other_jobs_keep_their_own(tmp_path):
    paths = []
    for rank, shift in [(0, 0), (1, 30)]:
        b = TraceBuilder(rank=rank)
        b.launch("gemm", 100 + shift, 100, at=90)
        paths.append(b.write(tmp_path / f"r{rank}.json"))
    t0, t1 = read_traces(paths)
    assert t1.spans[0].start_ms == pytest.approx(0.03, abs=1e-3) and t0.spans[0].start_ms == 0
    b = TraceBuilder(rank=0, base_ns=1_800_000_000_000_000_000)  # another job, years later
    b.launch("gemm", 100, 100, at=90)
    other = b.write(tmp_path / "other.json")
    a, c = read_traces([paths[0], other])
    assert a.spans[0].start_ms == 0 and c.spans[0].start_ms == 0


def test_cpu_trace_gives_worker_transfers_the_kinds_issued_in_order(tmp_path):
    b = TraceBuilder(world_size=2)
    b.cpu("overlapkit.comm.tp_all_gather:a", 0, 5, tid=1)
    b.cpu("overlapkit.comm.dp_all_reduce:b", 6, 5, tid=1)
    b.cpu("overlapkit.compute.mm", 12, 50, tid=1)
    b.cpu("gloo:all_gather", 8, 30, tid=2)  # gloo's worker threads, in issue order
    b.cpu("gloo:all_reduce", 40, 30, tid=3)
    b.cpu("overlapkit.comm.pp_send:c", 80, 10, tid=1)
    b.cpu("gloo:send", 82, 5, tid=1)  # send runs inside its own issue range
    b.cpu("gloo:recv", 95, 5, tid=1)  # nobody's: named by its collective
    t = read_trace(b.write(tmp_path / "cpu.json"))
    assert t.device == "cpu"
    assert [(s.kind, s.stream) for s in t.spans] == [
        ("tp_all_gather", "thread 2"), ("compute", "thread 1"), ("dp_all_reduce", "thread 3"),
        ("pp_send", "thread 1"), ("recv", "thread 1")]


def test_innermost_range_wins_however_many_came_before(tmp_path):
    b = TraceBuilder()
    b.cpu("overlapkit.compute.backward", 0, 1000)
    for i in range(40):  # many bucket transfers issued inside backward
        b.cpu(f"overlapkit.comm.dp_all_reduce:bucket{i}", 10 + 20 * i, 5)
        b.launch("ncclDevKernel_AllReduce_RING_LL(x)", 12 + 20 * i, 3, at=12 + 20 * i, stream=20)
    b.launch("gemm_dgrad", 900, 50, at=900)
    spans = read_trace(b.write(tmp_path / "nested.json")).spans
    assert [s.kind for s in spans].count("dp_all_reduce") == 40
    assert spans[-1].kind == "compute" and spans[-1].name == "backward"


def test_sizes_and_groups_from_older_collective_records(tmp_path):
    # param's DLRM traces: record_param_comms with only the shapes it was recorded with (Input Dims/type)
    # around the NCCL launch; newer ones name the group by Process Group Name when they give no ranks
    b = TraceBuilder()
    b.cpu("record_param_comms", 95, 10, cat="cpu_op", **{"Input Dims": [[6144], [], []],
                                                          "Input type": ["float", "Scalar", ""]})
    b.launch("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)", 100, 10,
             at=100, stream=20)
    b.cpu("record_param_comms", 195, 10, cat="cpu_op", **{"Input Dims": [[]], "Input type": ["TensorList"]})
    b.launch("ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)", 200, 10, at=200, stream=20)
    b.cpu("record_param_comms", 295, 10, cat="cpu_op", **{"Collective name": "allgather", "In msg nelems": 8,
                                                           "Out msg nelems": 16, "dtype": "BFloat16",
                                                           "Group size": 2, "Process Group Name": "3"})
    b.launch("ncclDevKernel_AllGather_RING_LL(x)", 300, 10, at=300, stream=20)
    spans = [s for s in read_trace(b.write(tmp_path / "t.json")).spans if s.is_comm]
    assert [(s.kind, s.nbytes, s.group_size, s.group) for s in spans] == [
        ("send_recv", 6144 * 4, 0, ""), ("all_reduce", 0, 0, ""), ("all_gather", 32, 2, "pg 3")]


def test_a_launch_that_waited_for_room_in_the_queue_is_a_wait_for_the_gpu_not_dispatch(tmp_path):
    from overlapkit.plan_tools import host_busy_ms

    b = TraceBuilder()
    b.cpu("ProfilerStep#1", 0, 2_000)
    b.cpu("ProfilerStep#2", 2_000, 2_000)
    b.cpu("ProfilerStep#3", 4_000, 100)  # the profiler's last step: dropped
    # step 1: twenty 5 µs launches (one 9 µs: jitter, kept as dispatch); step 2: two launches that sat 400 µs
    for i in range(20):
        b.launch(f"k{i}", 100 + 50 * i, 10, at=50 * i, launch_us=9 if i == 3 else 5)
    for i in range(2):
        b.launch(f"full{i}", 2_600 + 500 * i, 10, at=2_100 + 500 * i, launch_us=405)
    t = read_trace(b.write(tmp_path / "rank0.json"))
    step2 = t.step_ranges[2][0]  # the launches' times from step 2's start
    waits = sorted((round(a - step2, 3), round(b_ - step2, 3)) for _, a, b_ in t.launch_waits)
    assert waits == [(0.105, 0.505), (0.605, 1.005)]  # beyond the median launch (5 µs): 0.4 ms each
    assert not t.host_syncs  # the critical path's syncs stay the runtime's synchronizing calls
    assert host_busy_ms([t]) == pytest.approx((2.0 + 2.0 - 0.8) / 2)
