"""Write the tiny serving traces the timeline tests read (`python tests/data/serving/make_traces.py`).

`serving_gpu_rank0.json`: one prefill and two decode steps of a tensor-parallel server, marked by a user's
`record_function("prefill")` / `record_function("decode_step")`, with the serving stacks' all-reduce kernels
(names as their builds print them) beside GEMMs; the expected numbers are in tests/timeline/test_serving_steps.py.
Times in µs.
"""

import json
from pathlib import Path

KERNELS = [  # (name, start, end, launched at) on stream 7
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_tn", 100, 600, 10),           # prefill
    ("void vllm::cross_device_reduce_2stage<__nv_bfloat16, 2>(vllm::RankData*, vllm::RankSignals, "
     "vllm::Signal*, __nv_bfloat16*, int, int)", 600, 700, 20),
    ("ncclSymkDevKernel_AllGather_LL(ncclSymkDevWorkArgs4K)", 700, 750, 30),
    ("ampere_bf16_s16816gemm_bf16_64x64_ldg8_f2f_tn", 1100, 1200, 1010),         # decode 1
    ("void tensorrt_llm::kernels::ar_fusion::allreduce_fusion_kernel_oneshot_lamport<"
     "(tensorrt_llm::kernels::ar_fusion::AllReduceFusionPattern)1, __nv_bfloat16, 2, true, true>("
     "tensorrt_llm::kernels::ar_fusion::AllReduceFusionParams)", 1200, 1250, 1020),
    ("void c10d::symmetric_memory::(anonymous namespace)::one_shot_all_reduce_kernel<float, 16, 2>("
     "float**, float*, float*, unsigned long, unsigned long, unsigned int**, unsigned long, unsigned long)",
     1220, 1260, 1030),
    ("ampere_bf16_s16816gemm_bf16_64x64_ldg8_f2f_tn", 1600, 1700, 1510),         # decode 2
    ("void flashinfer::trtllm_mnnvl_allreduce::twoshotAllreduceKernel<(unsigned char)2, __nv_bfloat16, true, "
     "float4>(flashinfer::trtllm_mnnvl_allreduce::AllReduceFusionParams)", 1650, 1720, 1520),
    ("void flashinfer::trtllm_mnnvl_allreduce::rmsNormLamport<__nv_bfloat16>(flashinfer::trtllm_mnnvl_allreduce::"
     "RMSNormParams)", 1720, 1730, 1530),
]
RANGES = [("prefill", 0, 1000), ("decode_step", 1000, 1300), ("decode_step", 1500, 1560),
          ("decoder_layer_0", 1005, 1290)]  # a decoder layer's range is not a step


def events() -> list[dict]:
    out = [{"ph": "X", "cat": "user_annotation", "name": n, "pid": 10, "tid": 1, "ts": a, "dur": b - a, "args": {}}
           for n, a, b in RANGES]
    for i, (name, a, b, at) in enumerate(KERNELS):
        out.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 10, "tid": 1, "ts": at,
                    "dur": 1, "args": {"correlation": 100 + i}})
        out.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": a, "dur": b - a,
                    "args": {"stream": 7, "device": 0, "correlation": 100 + i}})
    return out


if __name__ == "__main__":
    doc = {"schemaVersion": 1, "baseTimeNanoseconds": 1_700_000_000_000_000_000,
           "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 2}, "traceEvents": events()}
    Path(__file__).with_name("serving_gpu_rank0.json").write_text(json.dumps(doc, indent=0) + "\n")
