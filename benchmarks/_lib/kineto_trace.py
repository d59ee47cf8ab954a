"""A one-rank PyTorch profiler (Kineto) trace of a given size, shaped like what `torch.profiler` writes for
an FSDP-style training step with `with_stack=True`: the test of record for reading large traces.

Per step: a `ProfilerStep#N` range; forward on the main thread (a Python frame stack per layer,
`aten::linear` -> `aten::addmm` -> `cudaLaunchKernel`, a GEMM on the compute stream), backward on the
autograd thread (`autograd::engine::evaluate_function: AddmmBackward0` -> two `aten::mm` GEMMs), an NCCL
all-gather per layer in forward and a reduce-scatter per layer in backward on two NCCL streams (with
their `record_param_comms` ops), a host-to-device copy at the step's start, an elementwise kernel on a
second compute stream, the optimizer's `multi_tensor_apply` kernels, `ac2g` flow pairs for every launch,
`gpu_user_annotation` images of the step, memory instants and process/thread metadata. Deterministic:
the same arguments write the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

BASE_NS = 1_760_000_000_000_000_000
PID, GPU = 4242, 0
MAIN, AUTOGRAD = 4242, 4250
COMPUTE, SIDE, NCCL_AG, NCCL_RS = 7, 13, 20, 24
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas"
EW = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, at::detail::Array<char*, 3>)"
AG = "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
RS = "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
ADAM = "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<c10::BFloat16, 4, (at::native::ADAM_MODE)1, false>, float*, float, float, float, float, float, float, float*, float*>"
STACK = ("train.py(212): <module>", "train.py(180): main", "train.py(131): train_step",
         "torch/nn/modules/module.py(1767): _call_impl", "model.py(88): forward",
         "torch/nn/modules/module.py(1767): _call_impl", "model.py(41): forward")
LAYER_BYTES = 1 << 24
EVENTS_PER_LAYER_BYTES = 9_000
"""About how many bytes of JSON one layer of one step writes (to size the trace)."""


class _Writer:
    def __init__(self, f) -> None:
        self.f, self.first, self.corr = f, True, 1_000

    def put(self, e: dict) -> None:
        self.f.write(("" if self.first else ",\n") + json.dumps(e, separators=(", ", ": ")))
        self.first = False

    def cpu(self, tid, name, ts, dur, cat="cpu_op", **args) -> None:
        self.put({"ph": "X", "cat": cat, "name": name, "pid": PID, "tid": tid, "ts": round(ts, 3),
                  "dur": round(dur, 3), "args": args})

    def launch(self, tid, ts, kernel, stream, start, dur, cat="kernel", **extra) -> None:
        """A launch on the host, its kernel on the GPU and the flow between them."""
        self.corr += 1
        c = self.corr
        self.put({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel" if cat == "kernel" else "cudaMemcpyAsync",
                  "pid": PID, "tid": tid, "ts": round(ts, 3), "dur": 4.1,
                  "args": {"External id": c, "cbid": 211, "correlation": c}})
        self.put({"ph": "s", "id": c, "pid": PID, "tid": tid, "ts": round(ts, 3), "cat": "ac2g", "name": "ac2g"})
        args = {"External id": c, "queued": 0, "device": GPU, "context": 1, "stream": stream, "correlation": c}
        if cat == "kernel":
            args |= {"registers per thread": 168, "shared memory": 213000, "blocks per SM": 1.05,
                     "warps per SM": 4.2, "grid": [132, 1, 1], "block": [384, 1, 1],
                     "est. achieved occupancy %": 6}
        self.put({"ph": "X", "cat": cat, "name": kernel, "pid": GPU, "tid": stream, "ts": round(start, 3),
                  "dur": round(dur, 3), "args": args | extra})
        self.put({"ph": "f", "id": c, "pid": GPU, "tid": stream, "ts": round(start, 3), "cat": "ac2g",
                  "name": "ac2g", "bp": "e"})


def _comm(kind: str, world: int) -> dict:
    return {"Collective name": kind, "In msg nelems": LAYER_BYTES // 2 // world, "Out msg nelems": LAYER_BYTES // 2,
            "dtype": "BFloat16", "Group size": world, "Process Group Name": "0",
            "Process Group Description": "default_pg", "Process Group Ranks": str(list(range(world)))}


def _step(w: _Writer, step: int, t: float, layers: int, world: int) -> float:
    """One training step from host time t (µs); returns when the next may start."""
    gpu = t + 30.0  # when the compute stream is next free
    w.cpu(MAIN, "aten::copy_", t + 2, 20, **{"Input Dims": [[8, 4096], [8, 4096]]})
    w.launch(MAIN, t + 5, "Memcpy HtoD (Pinned -> Device)", COMPUTE, gpu, 12.0, cat="gpu_memcpy",
             bytes=8 * 4096 * 8, **{"memory bandwidth (GB/s)": 21.8})
    gpu += 12.0
    host = t + 40.0
    w.cpu(MAIN, "## forward ##", host, layers * 60.0, cat="user_annotation")
    for layer in range(layers):  # forward: gather the next layer's weights while this one computes
        for depth, frame in enumerate(STACK):
            w.cpu(MAIN, frame, host + depth * 0.2, 55.0 - depth * 0.4, cat="python_function",
                  **{"Python id": layer * 10 + depth, "Python parent id": layer * 10 + depth - 1})
        w.cpu(MAIN, "record_param_comms", host + 3, 4.0, **_comm("all_gather", world))
        w.launch(MAIN, host + 4, AG, NCCL_AG, max(gpu - 40, host + 9), 38.0, **_comm("all_gather", world))
        w.cpu(MAIN, "aten::linear", host + 10, 30.0, **{"Input Dims": [[8, 4096], [4096, 4096], [4096]]})
        w.cpu(MAIN, "aten::addmm", host + 12, 25.0)
        w.launch(MAIN, host + 20, GEMM, COMPUTE, max(gpu, host + 25), 48.0)
        gpu = max(gpu, host + 25) + 48.0
        w.launch(MAIN, host + 40, EW, SIDE, gpu, 6.0)
        host += 60.0
    bwd = max(host, gpu - 400.0)
    for layer in reversed(range(layers)):  # backward on the autograd thread, reduce-scatter per layer
        w.cpu(AUTOGRAD, "autograd::engine::evaluate_function: AddmmBackward0", bwd, 70.0)
        w.cpu(AUTOGRAD, "AddmmBackward0", bwd + 1, 66.0)
        for k in range(2):
            w.cpu(AUTOGRAD, "aten::mm", bwd + 3 + 30 * k, 25.0, **{"Input Dims": [[8, 4096], [4096, 4096]]})
            w.launch(AUTOGRAD, bwd + 8 + 30 * k, GEMM, COMPUTE, max(gpu, bwd + 12 + 30 * k), 48.0)
            gpu = max(gpu, bwd + 12 + 30 * k) + 48.0
        w.cpu(AUTOGRAD, "record_param_comms", bwd + 66, 3.0, **_comm("reduce_scatter", world))
        w.launch(AUTOGRAD, bwd + 67, RS, NCCL_RS, gpu, 70.0, **_comm("reduce_scatter", world))
        w.put({"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "pid": PID, "tid": AUTOGRAD, "s": "t",
               "ts": round(bwd + 68, 3), "args": {"Total Reserved": 1 << 33, "Total Allocated": 1 << 32,
                                                  "Bytes": 1 << 22, "Addr": 139_000_000 + layer, "Device Id": 0,
                                                  "Device Type": 1}})
        bwd += 72.0
    gpu += 70.0
    opt = max(bwd, gpu)
    w.cpu(MAIN, "Optimizer.step#AdamW.step", opt, 40.0, cat="user_annotation")
    w.cpu(MAIN, "aten::_fused_adamw_", opt + 2, 35.0)
    w.launch(MAIN, opt + 5, ADAM, COMPUTE, max(gpu, opt + 9), 30.0)
    end = max(gpu, opt + 9) + 30.0 + 20.0
    w.cpu(MAIN, f"ProfilerStep#{step}", t, end - t, cat="user_annotation")
    w.put({"ph": "X", "cat": "gpu_user_annotation", "name": f"ProfilerStep#{step}", "pid": GPU, "tid": COMPUTE,
           "ts": round(t + 30, 3), "dur": round(end - t - 30, 3), "args": {}})
    return end + 15.0


def write_trace(path: str | Path, mb: float, rank: int = 0, world: int = 8, layers: int = 48) -> int:
    """Write one rank's trace of about `mb` MB (at least one step of `layers` layers); returns its size in bytes."""
    steps = max(2, round(mb * 1e6 / (layers * EVENTS_PER_LAYER_BYTES)))
    path = Path(path)
    with open(path, "w") as f:
        f.write('{\n  "schemaVersion": 1,\n  "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3", '
                '"totalGlobalMem": 85029158912, "computeMajor": 9, "computeMinor": 0, "numSms": 132}],\n'
                f'  "distributedInfo": {{"backend": "nccl", "rank": {rank}, "world_size": {world}}},\n'
                '  "record_shapes": 1, "with_stack": 1,\n  "traceEvents": [\n')
        w = _Writer(f)
        for pid, tid, name in ((PID, MAIN, "python main"), (PID, AUTOGRAD, "autograd"), (GPU, COMPUTE, "stream 7"),
                               (GPU, SIDE, "stream 13"), (GPU, NCCL_AG, "stream 20"), (GPU, NCCL_RS, "stream 24")):
            w.put({"name": "thread_name", "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": {"name": name}})
        t = 1_000.0
        for step in range(steps):
            t = _step(w, step, t, layers, world)
        f.write(f'\n  ],\n  "traceName": "{path.name}",\n  "baseTimeNanoseconds": {BASE_NS},\n'
                '  "displayTimeUnit": "ms"\n}\n')
    return path.stat().st_size
