"""Which GPU kernels and copies of a trace are communication, and which collective each one is.

Overlap is communication hidden behind computation, so every transfer a trace holds must be
told apart from compute, whoever wrote the kernel: NCCL/RCCL collectives (NCCL's symmetric
`ncclSymk*` kernels too), DeepEP's expert-parallel dispatch/combine kernels, TransformerEngine's
userbuffers kernels, PyTorch symmetric-memory kernels, NVSHMEM, the serving stacks' all-reduces
(vLLM's custom all-reduce, FlashInfer's and TensorRT-LLM's one-shot/two-shot and fused
all-reduce + norm kernels) and peer-to-peer copies (copy-engine pulls between GPUs).
"""

from __future__ import annotations

import re
from functools import lru_cache

from ..runtime.spans import COMM_RANGE_PREFIX, COMPUTE_RANGE_PREFIX, WAIT_RANGE

_NCCL = re.compile(r"^(?:nccl|rccl)", re.IGNORECASE)
# ncclDevKernel_AllReduce_..., and NCCL's symmetric-memory kernels ncclSymkDevKernel_AllReduce_AGxLL_R_sum_f32
# (ncclSymDevKernel_ in NCCL 2.27)
_NCCL_COLLECTIVE = re.compile(r"^(?:nccl|rccl)(?:Symk?)?(?:Dev)?Kernel_([A-Za-z]+)", re.IGNORECASE)
# DeepEP (deep_ep::intranode|internode|internode_ll::dispatch|combine|notify_dispatch|...), also
# its in-house build seen in DeepSeek's published profile (dpsk::ep::...).
_DEEPEP = re.compile(r"\b(?:deep_ep|dpsk::ep)::(?:intranode|internode|internode_ll)::(\w+)")
_USERBUFFERS = re.compile(r"\bk?userbuffers_(\w+)", re.IGNORECASE)
_SYMM_MEM = re.compile(r"\b(?:c10d::symmetric_memory|symm_mem)::(\w+)")
_NVSHMEM = re.compile(r"\bnvshmem\w*", re.IGNORECASE)
_PEER_COPY = re.compile(r"\bPtoP\b")
# The serving stacks' all-reduce kernels, all one collective whatever else they fuse (a residual add, an RMSNorm,
# a quantization): vLLM's custom all-reduce (vllm::cross_device_reduce_1stage / _2stage); TensorRT-LLM's and
# FlashInfer's (ar_fusion::allreduce_fusion_kernel_oneshot_lamport / _twoshot_sync, moereduce_allreduce_fusion_*,
# oneShotAllReduceKernel / twoShotAllReduceKernel, MNNVL's oneshotAllreduceFusionKernel / twoshotAllreduceKernel
# and the rmsNormLamport that finishes it, lamport buffer initialisation); torch's symmetric-memory kernels
# (one_shot_all_reduce_kernel, two_shot_all_reduce_kernel, multimem_all_reduce_kernel), whose namespace a
# demangled name may hide behind "(anonymous namespace)".
_SERVING_ALL_REDUCE = re.compile(r"cross_device_reduce_\dstage|allreduce_fusion|(?:one|two)_?shot_?all_?reduce|lamport",
                                 re.IGNORECASE)
_MULTIMEM = re.compile(r"\bmultimem_(\w+)")


def collective_kind(name: str) -> str:
    """`allreduce`, `_allgather_base`, `AllReduce`, `gloo:all_reduce`, `c10d::allreduce_` -> `all_reduce` and so on."""
    n = name.rsplit(":", 1)[-1]  # the op after its namespace (`gloo:`, `c10d::`)
    n = re.sub(r"(?<=[a-z])(?=[A-Z])", "_", n).lower().strip("_")
    for suffix in ("_coalesced", "_into_tensor", "_tensor", "_base", "_single"):
        n = n.replace(suffix, "")
    aliases = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
               "alltoall": "all_to_all", "alltoallv": "all_to_all", "all_to_allv": "all_to_all",
               "sendrecv": "send_recv", "recv_": "recv", "generic": "nccl"}
    n = n.strip("_")
    return aliases.get(n, n) or "nccl"


def _from_function(fn: str) -> str | None:
    """The collective a kernel function's name says it does, when it says one."""
    f = fn.lower()
    for needle, kind in (("all_reduce", "all_reduce"), ("allreduce", "all_reduce"),
                         ("reduce_scatter", "reduce_scatter"), ("all_gather", "all_gather"),
                         ("allgather", "all_gather"), ("all_to_all", "all_to_all"), ("alltoall", "all_to_all")):
        if needle in f:
            return kind
    return None


def is_nccl(name: str) -> bool:
    """An NCCL or RCCL kernel (its collective metadata may sit in args or a record_param_comms op)."""
    return _NCCL.match(name) is not None


def nccl_kind_from_name(name: str) -> str:
    """`ncclDevKernel_AllReduce_RING_LL(...)` -> `all_reduce`; `nccl` when the name says nothing."""
    m = _NCCL_COLLECTIVE.match(name)
    return collective_kind(m.group(1)) if m else "nccl"


@lru_cache(maxsize=65536)
def kernel_comm_kind(name: str) -> str | None:
    """The communication kind of a non-NCCL kernel, or None when it is compute.

    DeepEP: `ep_dispatch` (dispatch, notify_dispatch), `ep_combine` (combine), `ep_notify`
    (cached_notify, shared by both). userbuffers: the collective its name carries (`_rs` ->
    reduce_scatter, `_ag` -> all_gather), else `userbuffers`. Symmetric memory and NVSHMEM: the
    collective in the function name, else `symm_mem` / `nvshmem`. The serving stacks' all-reduce
    kernels (vLLM, FlashInfer, TensorRT-LLM, torch's one-shot/two-shot): `all_reduce`.
    """
    if (m := _DEEPEP.search(name)) is not None:
        fn = m.group(1)
        if "dispatch" in fn:
            return "ep_dispatch"
        return "ep_combine" if "combine" in fn else "ep_notify"
    if (m := _USERBUFFERS.search(name)) is not None:
        fn = m.group(1).lower()
        if fn.endswith("_rs") or "reduce_scatter" in fn:
            return "reduce_scatter"
        if fn.endswith("_ag") or "all_gather" in fn:
            return "all_gather"
        return "userbuffers"
    if (m := _SYMM_MEM.search(name)) is not None:
        return _from_function(m.group(1)) or "symm_mem"
    if _SERVING_ALL_REDUCE.search(name) is not None:
        return "all_reduce"
    if (m := _MULTIMEM.search(name)) is not None:
        return _from_function(m.group(1)) or "symm_mem"
    if _NVSHMEM.search(name) is not None:
        return _from_function(name) or "nvshmem"
    return None


def copy_comm_kind(name: str) -> str | None:
    """A peer-to-peer copy (`Memcpy PtoP`: one GPU's copy engine pulling from another) is communication."""
    return "p2p_copy" if _PEER_COPY.search(name) else None


def range_label(name: str) -> tuple[str, str]:
    """('comm', kind), ('compute', name) or ('wait', '') for an overlapkit range name."""
    if name == WAIT_RANGE:
        return "wait", ""
    if name.startswith(COMM_RANGE_PREFIX):
        return "comm", name[len(COMM_RANGE_PREFIX):].split(":", 1)[0]
    return "compute", name[len(COMPUTE_RANGE_PREFIX):]
