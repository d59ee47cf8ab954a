"""Defects the third-party trace corpus showed, each on (a trimmed copy of) the trace that shows it.

The traces are in tests/data/timeline (see its README for sources and trimming). Every expected
figure is derived here from the raw events by a count independent of the reader.
"""

import gzip
import json
import re
from pathlib import Path

import pytest

from overlapkit.runtime import intervals as iv
from overlapkit.timeline import read_trace, report_traces
from overlapkit.timeline.cli import main
from overlapkit.timeline.kinds import copy_comm_kind, kernel_comm_kind
from overlapkit.timeline.trace import TraceError

DATA = Path(__file__).resolve().parents[1] / "data" / "timeline"


def _events(name):
    return [e for e in json.loads(gzip.decompress((DATA / name).read_bytes()))["traceEvents"] if e.get("ph") == "X"]


def _before_last_step(events):
    steps = sorted(e["ts"] for e in events if e["name"].startswith("ProfilerStep#"))
    return steps[-1] if len(steps) >= 2 else float("inf")


@pytest.mark.parametrize("name, reference", [("gloo_ddp_rank0.json.gz", 74.5), ("gloo_ddp_rank1.json.gz", 80.0)])
def test_plain_gloo_ddp_overlap_counts_its_cpu_ops_as_compute(name, reference):
    # Independent count: compute = union of the cpu_op events of the threads that run no gloo
    # range (DDP's main/autograd thread), leaving out c10d issue ops and waits; communication =
    # union of the gloo ranges; both before the last ProfilerStep (dropped, as HTA does).
    ev = _events(name)
    cut = _before_last_step(ev)
    gloo = [e for e in ev if e["name"].startswith("gloo:") and e["ts"] < cut]
    comm_tids = {e["tid"] for e in gloo}
    compute = iv.union((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("cat") == "cpu_op" and e["ts"] < cut
                       and e["tid"] not in comm_tids and not e["name"].startswith("c10d::")
                       and "wait" not in e["name"].lower())
    comm = iv.union((e["ts"], e["ts"] + e["dur"]) for e in gloo)
    expected = 100 * iv.length(iv.intersect(comm, compute)) / iv.length(comm)
    assert expected == pytest.approx(reference, abs=0.6)  # the corpus's own note: ~74.5 % and ~80 %
    row = report_traces([read_trace(DATA / name)]).ranks[0]
    assert row.compute_known and row.total.overlap_pct == pytest.approx(expected, abs=0.01)
    # DDP's bucket all-reduces are issued from backward: that is their phase
    phases = {s.phase for s in read_trace(DATA / name).spans if s.is_comm}
    assert phases == {"backward"}


def test_gloo_trace_without_cpu_ops_has_unknown_overlap_not_zero():
    # HTA's 300-rank gloo trace (rank 34): ten gloo all-reduces (1.10 s of transfers), and the
    # only CPU ops are four aten::empty (about 4 µs) after the last transfer ended.
    ev = _events("hta_cpu_only_rank34.json.gz")
    ops = [e for e in ev if e.get("cat") == "cpu_op"]
    last_comm_end = max(e["ts"] + e["dur"] for e in ev if e["name"].startswith("gloo:"))
    assert len(ops) == 4 and all(e["ts"] > last_comm_end for e in ops)
    t = read_trace(DATA / "hta_cpu_only_rank34.json.gz")
    row = report_traces([t]).ranks[0]
    assert not t.compute_known and "no computation" in t.notes[0]
    assert row.total.overlap_pct is None and row.total.exposed_comm_ms is None
    assert row.total.comm_ms == pytest.approx(1102.98, abs=0.01)  # merged gloo ranges, as counted above
    assert row.to_dict()["compute_known"] is False


def test_mtia_trace_is_refused_as_an_unsupported_device(capsys):
    path = DATA / "mtia_inference_trimmed.json.gz"
    assert any(e.get("cat", "").startswith("mtia_") for e in _events(path.name))
    with pytest.raises(TraceError, match="unsupported device: MTIA"):
        read_trace(path, rank=0)
    assert main([str(path), "--rank", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unsupported device" in err and err.count("\n") == 0


def test_our_dataparallel_forward_does_not_count_its_waits_as_compute():
    # The demo (TP2 x DP2, 3 steps, rank 0; trimmed to overlapkit/gloo ranges and steps): the
    # DataParallel `overlapkit.compute.forward` range encloses the TP layers' waits. Compute is
    # the compute ranges minus the `overlapkit.wait` ranges of the same thread.
    ev = _events("demo_tp2dp2_rank0.json.gz")
    ranges = iv.union((e["ts"], e["ts"] + e["dur"]) for e in ev if e["name"].startswith("overlapkit.compute."))
    waits = iv.union((e["ts"], e["ts"] + e["dur"]) for e in ev if e["name"] == "overlapkit.wait")
    expected_ms = iv.length(iv.subtract(ranges, waits)) / 1e3
    row = report_traces([read_trace(DATA / "demo_tp2dp2_rank0.json.gz", last_step=True)]).ranks[0]
    assert row.total.compute_ms == pytest.approx(expected_ms, rel=1e-9)
    assert iv.length(ranges) / 1e3 > expected_ms + 30  # the waits the old reading counted as compute
    # the demo's recorder measured 146.5 ms of compute on this rank: the two sources now agree
    assert row.total.compute_ms == pytest.approx(146.5, rel=0.05)


def test_deepep_kernels_are_communication():
    # DeepSeek's published EP64 training profile: DeepEP's dispatch/combine/notify kernels are
    # dpsk::ep::{intra,inter}node::*; dpsk::ep::cuda::get_dispatch_layout is local compute.
    ev = [e for e in _events("deepseek_train_gpu.json.gz") if e.get("cat") == "kernel"]
    ep = [e for e in ev if re.search(r"::ep::(?:intra|inter)node", e["name"])]
    counts = {k: sum(1 for e in ep if kernel_comm_kind(e["name"]) == k) for k in ("ep_dispatch", "ep_combine", "ep_notify")}
    assert counts == {"ep_dispatch": 12, "ep_combine": 8, "ep_notify": 12}
    comm = iv.union((e["ts"], e["ts"] + e["dur"]) for e in ep)
    compute = iv.union((e["ts"], e["ts"] + e["dur"]) for e in ev if e not in ep)
    expected = 100 * iv.length(iv.intersect(comm, compute)) / iv.length(comm)
    row = report_traces([read_trace(DATA / "deepseek_train_gpu.json.gz", rank=0)]).ranks[0]
    assert {k.kind: k.count for k in row.by_kind} == counts
    assert row.total.overlap_pct == pytest.approx(expected, abs=1e-6) and expected == pytest.approx(96.3, abs=0.1)


def test_other_non_nccl_transfers_are_communication():
    assert kernel_comm_kind("void userbuffers_fp16_sum_inplace_gpu_rr_rs<2>(int, int)") == "reduce_scatter"
    assert kernel_comm_kind("kuserbuffers_pushrecv(int, int*, int4*)") == "userbuffers"
    assert kernel_comm_kind("void c10d::symmetric_memory::one_shot_all_reduce_kernel<float, 8>(...)") == "all_reduce"
    assert kernel_comm_kind("nvshmemi_transfer_rma_kernel") == "nvshmem"
    assert kernel_comm_kind("ampere_sgemm_128x64_nn") is None
    assert copy_comm_kind("Memcpy PtoP (Device -> Device)") == "p2p_copy"
    assert copy_comm_kind("Memcpy DtoD (Device -> Device)") is None


def test_kernels_without_a_launch_belong_to_no_step():
    # kineto's resnet50 sample (first two steps kept): 733 kernels/memsets have no runtime
    # launch with their correlation id; their GPU start lies inside ProfilerStep#5.
    ev = _events("resnet50_nw0_two_steps.json.gz")
    launches = {e["args"]["correlation"]: e["ts"] for e in ev if e.get("cat") == "Runtime"}
    gpu = [e for e in ev if e.get("cat") in ("Kernel", "Memset", "Memcpy")]
    launchless = [e for e in gpu if e["args"].get("correlation") not in launches]
    assert len(launchless) == 733
    step5 = next(e for e in ev if e["name"] == "ProfilerStep#5")
    in5 = [e for e in gpu if e.get("cat") == "Kernel" and step5["ts"] <= launches.get(e["args"].get("correlation"), -1)
           <= step5["ts"] + step5["dur"]]
    expected_ms = iv.length(iv.union((e["ts"], e["ts"] + e["dur"]) for e in in5)) / 1e3
    t = read_trace(DATA / "resnet50_nw0_two_steps.json.gz", rank=0)
    steps = dict(report_traces([t]).ranks[0].steps)
    assert steps[5].compute_ms == pytest.approx(expected_ms, rel=1e-9)
    assert sum(1 for s in t.spans if s.step is None) == 733 and "733 GPU events have no launch" in t.notes[0]
