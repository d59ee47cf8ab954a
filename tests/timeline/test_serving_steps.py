"""The analyzer reads a serving trace: the serving stacks' all-reduce kernels are communication of the right
kind, and `overlapkit analyze` prints exposed communication per prefill and per decode step.

tests/data/serving/serving_gpu_rank0.json (written by its make_traces.py): a prefill and two decode steps
marked by a user's record_function ranges, vLLM's custom all-reduce, NCCL's symmetric kernels, TensorRT-LLM's
and FlashInfer's fused all-reduce kernels and torch's one-shot kernel beside GEMMs, a decoder layer's range
that is not a step, and a kernel that runs after its step's CPU range closed.
"""

import json
import re
from pathlib import Path

import pytest

from overlapkit.timeline.cli import main
from overlapkit.timeline.kinds import kernel_comm_kind, nccl_kind_from_name
from overlapkit.timeline.serving import by_kind, step_kind, trace_steps
from overlapkit.timeline.trace import read_trace

TRACE = Path(__file__).parents[1] / "data" / "serving" / "serving_gpu_rank0.json"


@pytest.mark.parametrize("name, kind", [
    ("void vllm::cross_device_reduce_1stage<float, 8>(vllm::RankData*, vllm::RankSignals, vllm::Signal*, float*, "
     "int, int)", "all_reduce"),
    ("void vllm::cross_device_reduce_2stage<__nv_bfloat16, 4>(...)", "all_reduce"),
    ("void tensorrt_llm::kernels::ar_fusion::allreduce_fusion_kernel_oneshot_lamport<(tensorrt_llm::kernels::"
     "ar_fusion::AllReduceFusionPattern)1, __nv_bfloat16, 8, true, true>(...)", "all_reduce"),
    ("void flashinfer::trtllm_allreduce_fusion::allreduce_fusion_kernel_twoshot_sync<__nv_bfloat16, 4, true>(...)",
     "all_reduce"),
    ("void tensorrt_llm::kernels::moereduce_allreduce_fusion_kernel_oneshot_lamport<__nv_bfloat16, 8>(...)",
     "all_reduce"),
    ("void flashinfer::trtllm_mnnvl_allreduce::oneshotAllreduceFusionKernel<(unsigned char)2, __nv_bfloat16, true>"
     "(...)", "all_reduce"),
    ("void flashinfer::trtllm_mnnvl_allreduce::twoshotAllreduceKernel<(unsigned char)4, __nv_bfloat16, true, "
     "float4>(...)", "all_reduce"),
    ("void tensorrt_llm::kernels::oneShotAllReduceKernel<__nv_bfloat16, 8, false, false>(...)", "all_reduce"),
    ("void tensorrt_llm::kernels::twoShotAllReduceKernel<__nv_bfloat16, 8, false, false>(...)", "all_reduce"),
    ("void flashinfer::trtllm_mnnvl_allreduce::rmsNormLamport<__nv_bfloat16>(...)", "all_reduce"),
    ("void tensorrt_llm::kernels::ar_fusion::lamport_initialize_kernel<float>(float*, int)", "all_reduce"),
    ("void c10d::symmetric_memory::(anonymous namespace)::one_shot_all_reduce_kernel<float, 16, 8>(...)",
     "all_reduce"),
    ("void c10d::symmetric_memory::(anonymous namespace)::two_shot_all_reduce_kernel<float, 16, 8>(...)",
     "all_reduce"),
    ("void c10d::symmetric_memory::(anonymous namespace)::multimem_all_reduce_kernel<16>(...)", "all_reduce"),
    ("void c10d::symmetric_memory::(anonymous namespace)::multimem_all_gather_kernel<16>(...)", "all_gather"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>(...)", None),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", None),
    ("void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>(...)", None),
])
def test_serving_stack_kernels_are_communication_of_their_collective(name, kind):
    assert kernel_comm_kind(name) == kind


def test_nccl_symmetric_kernels_name_their_collective():
    assert nccl_kind_from_name("ncclSymkDevKernel_AllReduce_AGxLL_R_sum_f32(ncclSymkDevWorkArgs4K)") == "all_reduce"
    assert nccl_kind_from_name("ncclSymkDevKernel_AllGather_LL(ncclSymkDevWorkArgs4K)") == "all_gather"
    assert nccl_kind_from_name("ncclSymkDevKernel_ReduceScatter_LDMC_sum_f8e4m3(x)") == "reduce_scatter"
    assert nccl_kind_from_name("ncclSymDevKernel_AllReduce_RSxLD_AGxST_sum_bf16(x)") == "all_reduce"
    assert nccl_kind_from_name("ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)") == "all_reduce"


def test_step_rule():
    for name, kind in [("prefill", "prefill"), ("decode_step", "decode"), ("Decode#12", "decode"),
                       ("overlapkit.compute.decode", "decode"), ("overlapkit.compute.prefill", "prefill"),
                       ("PREFILL chunk 2", "prefill"), ("decoder_layer_0", None), ("prefilled", None),
                       ("ProfilerStep#3", None), ("overlapkit.compute.q_proj.fwd.gemm", None), ("my_decode", None)]:
        assert step_kind(name) == kind, name


def test_trace_cut_into_prefill_and_decode_steps():
    trace = read_trace(TRACE)
    kinds = {re.search(r"(\w+)[<(]", s.name).group(1): s.kind for s in trace.spans if s.is_comm}
    assert kinds == {"cross_device_reduce_2stage": "all_reduce", "ncclSymkDevKernel_AllGather_LL": "all_gather",
                     "allreduce_fusion_kernel_oneshot_lamport": "all_reduce",
                     "one_shot_all_reduce_kernel": "all_reduce", "twoshotAllreduceKernel": "all_reduce",
                     "rmsNormLamport": "all_reduce"}
    # ms from the trace's first kernel (0.1 ms into the file); the decoder layer's range is not a step
    assert [(k, round(a, 3), round(b, 3)) for k, a, b in trace.serving_ranges] == [
        ("prefill", -0.1, 0.9), ("decode", 0.9, 1.2), ("decode", 1.4, 1.46)]
    steps = trace_steps(trace)
    got = [{k: round(v, 3) if isinstance(v, float) else v for k, v in s.items()} for s in steps]
    assert got == [
        # prefill: both transfers after the GEMM, nothing beside them
        dict(kind="prefill", step_ms=1.0, comm_ms=0.15, exposed_ms=0.15, comm_spans=2),
        # decode 1: [1.20, 1.26] of transfers after the GEMM ends at 1.20
        dict(kind="decode", step_ms=0.3, comm_ms=0.06, exposed_ms=0.06, comm_spans=2),
        # decode 2: launched in [1.50, 1.56], run until 1.73; the GEMM hides [1.65, 1.70] of [1.65, 1.73]
        dict(kind="decode", step_ms=0.23, comm_ms=0.08, exposed_ms=0.03, comm_spans=2),
    ]
    rows = by_kind(0, steps)
    assert [(r.kind, r.steps, round(r.step_ms, 3), round(r.comm_ms, 3), round(r.exposed_ms, 3)) for r in rows] == [
        ("prefill", 1, 1.0, 0.15, 0.15), ("decode", 2, 0.265, 0.07, 0.045)]


def test_analyze_prints_and_writes_the_serving_rows(capsys):
    assert main([str(TRACE), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(r["kind"], r["steps"], round(r["exposed_ms"], 3)) for r in doc["serving_steps"]] == [
        ("prefill", 1, 0.15), ("decode", 2, 0.045)]
    assert main([str(TRACE)]) == 0
    out = capsys.readouterr().out
    assert "Exposed communication per serving step" in out and "decode" in out


def test_a_trace_without_steps_has_no_serving_rows(tmp_path, capsys):
    doc = json.loads(TRACE.read_text())
    doc["traceEvents"] = [e for e in doc["traceEvents"] if e["cat"] != "user_annotation"]
    path = tmp_path / "no_steps.json"
    path.write_text(json.dumps(doc))
    assert read_trace(path).serving_ranges == []
    assert main([str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["serving_steps"] == []
