"""The switches the diagnosis offers, each only where the trace's evidence says it fits the job.

Every "try" is built here from the job (`timeline/framework.py`: framework, device, what is
already on) and from what the critical path spent its time on, so that no line advises what
is already on (DDP already reduces during backward; CUDA graphs already replay the kernels),
names hardware the job does not have (a GPU, NVLink, CUDA_DEVICE_MAX_CONNECTIONS on a CPU
job), or points at a cause the trace does not show (a DataLoader the trace never waited for).
"""

from __future__ import annotations

from .framework import Job
from .phases import PIPELINE

LAUNCH_GAP_SHARE = 0.10
"""The critical path on the host above this share of the step: launch overhead is worth a try."""
LOADER_SHARE = 0.01
"""The critical path in the DataLoader above this share of the step: the input pipeline is worth a try."""
IDLE_SHARE = 0.10
"""The critical path in untraced time above this share of the step: say so."""


def _fw(job: Job, megatron: str = "", deepspeed: str = "", overlapkit: str = "", torch: str = "") -> str:
    """The switch's name in each framework the job runs, plus overlapkit's (Megatron's and DeepSpeed's only
    when the trace shows them)."""
    names = [n for f, n in (("megatron", megatron), ("deepspeed", deepspeed)) if n and job.has(f)]
    if torch and (job.has("ddp") or job.has("fsdp") or not job.frameworks):
        names.append(torch)
    if overlapkit:
        names.append(overlapkit if job.has("overlapkit") else f"overlapkit: {overlapkit}")
    return "; ".join(names)


def switch(phase: str, kind: str, bound: str | None, job: Job, hidden_pct: float | None) -> str:
    """The switch that hides or shrinks exposed `kind` communication of `phase`, fitted to the job."""
    gpu = job.gpu
    if phase == PIPELINE:
        return ("pipeline: overlap the send/recv with the other micro-batch (" + _fw(
            job, megatron="Megatron overlap_p2p_comm", overlapkit="overlap.pp=bulk") +
            "), interleaved 1F1B (vpp=2), more micro-batches per step")
    if kind == "send_recv":
        return ("all-to-all or point-to-point (an NCCL SendRecv kernel: embedding/expert exchange or pipeline "
                "transfers): chunk it against independent compute (" + _fw(
                    job, overlapkit="overlap.ep=pipelined; overlap.pp=bulk", megatron="Megatron MoE a2a overlap")
                + ")")
    if kind.startswith("ep_") or kind == "all_to_all":
        return "expert parallel: chunk dispatch/combine against the expert GEMMs (" + _fw(
            job, overlapkit="overlap.ep=pipelined", megatron="Megatron moe a2a overlap") + ")"
    if kind.startswith("tp_") or (phase == "forward" and kind in ("all_reduce", "reduce_scatter")
                                  and not job.has("ddp")):
        out = "tensor parallel: " + _fw(job, overlapkit="overlap='pipelined' or 'auto' in the TP layers",
                                        megatron="Megatron tp_comm_overlap", torch="torch async TP")
        out += " (sequence parallelism first)"
        if gpu:
            out += ", CUDA_DEVICE_MAX_CONNECTIONS=1 so the collective is not queued behind GEMMs"
        return out
    if kind in ("reduce_scatter", "zero_reduce_scatter") and job.has("fsdp"):
        return ("FSDP: its reduce-scatters already run during backward; a bigger wrapping unit (fewer, larger "
                "reduce-scatters) if they are latency-bound, or reshard_after_forward=False for the last blocks")
    if phase == "backward" or kind in ("dp_all_reduce", "dp_reduce_scatter"):
        return _data_parallel(bound, job, hidden_pct)
    if kind in ("all_gather", "zero_all_gather") or phase == "optimizer":
        if job.has("fsdp_prefetch"):
            return ("FSDP2 already prefetches forward gathers explicitly: prefetch more modules ahead "
                    "(set_modules_to_forward_prefetch with two or more)")
        return ("ZeRO/FSDP: prefetch parameter gathers behind earlier layers (" + _fw(
            job, overlapkit="fully_shard(overlap='auto' | 'bulk', prefetch_depth=...)",
            megatron="Megatron overlap_param_gather", deepspeed="DeepSpeed overlap_comm",
            torch="FSDP2 set_modules_to_forward_prefetch") + ")")
    return "overlap mode of the engine that issues it (overlap='bulk' or 'auto')"


def _data_parallel(bound: str | None, job: Job, hidden_pct: float | None) -> str:
    buckets = _fw(job, overlapkit="DataParallel(bucket_mb=...)", torch="DDP bucket_cap_mb",
                  megatron="Megatron bucket_size", deepspeed="DeepSpeed reduce_bucket_size")
    already = job.has("ddp") or job.has("fsdp") or (job.has("overlapkit") and (hidden_pct or 0) >= 30)
    if bound == "latency":
        return (f"data parallel: bigger gradient buckets ({buckets}): these all-reduces are latency-bound, "
                f"fewer and larger ones cost less")
    if already:
        who = "DDP's reducer" if job.has("ddp") else "FSDP" if job.has("fsdp") else "DataParallel"
        return (f"data parallel: {who} already reduces gradients during backward; what stays exposed is the "
                f"tail after the last gradient: a smaller last bucket ({buckets}), or more backward compute "
                f"per reduction (gradient accumulation, a larger micro-batch)")
    return (f"data parallel: reduce gradients during backward ({_fw(job, overlapkit='DataParallel overlap', torch='DDP', megatron='Megatron overlap_grad_reduce', deepspeed='DeepSpeed overlap_comm')}), "
            f"bucket size ({buckets}: smaller buckets start sooner), a small first bucket for the tail")


def host_stall(job: Job, path_share: dict, path_ops: dict, step_ms: float = 0.0) -> str:
    """What to try when compute is not saturated, from what the critical path did instead
    (`path_share`: why -> share of the step; `path_ops`: host op name -> ms per step on the path)."""
    tries = []
    loader_ms = sum(ms for op, ms in path_ops.items() if "DataLoader" in op)
    if loader_ms > 0 and loader_ms >= LOADER_SHARE * step_ms:
        if job.has("loader_workers"):
            tries.append("input pipeline: the path waits in the DataLoader although it has workers: more workers, "
                         "pin_memory, prefetch_factor")
        else:
            tries.append(f"input pipeline: the path waits {loader_ms:.2f} ms per step in a single-process DataLoader: "
                         f"DataLoader(num_workers>0)")
    if job.gpu and path_share.get("host launch gap", 0) >= LAUNCH_GAP_SHARE:
        fixes = [f for f, on in (("CUDA graphs", job.has("cuda_graph")), ("torch.compile", job.has("compiled")))
                 if not on]
        if fixes:
            tries.append(f"launch overhead: the GPU waits for the host {100 * path_share['host launch gap']:.0f}% of "
                         f"the step: {' or '.join(fixes)}")
        else:
            tries.append(f"launch overhead: the GPU waits for the host {100 * path_share['host launch gap']:.0f}% of "
                         f"the step although CUDA graphs and torch.compile are on: the host work between graphs")
    if job.gpu and job.has("host_sync") and path_share.get("host launch gap", 0) >= LAUNCH_GAP_SHARE:
        tries.append(f"host syncs: {job.evidence['host_sync']} waits of the host for the GPU in the trace "
                     f"(.item(), .cpu(), cudaStreamSynchronize)")
    if path_share.get("idle", 0) >= IDLE_SHARE:
        tries.append(f"untraced time: {100 * path_share['idle']:.0f}% of the critical path ran nothing traced "
                     f"(Python between ops, sleeps, waits on something not profiled)")
    if not job.gpu and path_share.get("compute", 0) >= 0.5:
        tries.append("on CPU the step is bound by computation: threads per rank (torch.set_num_threads) and ranks "
                     "per core, not communication")
    return "; ".join(tries)


def straggler(job: Job, rank: int) -> str:
    return (f"look at rank {rank}'s own work first (uneven layers or data, "
            + ("a slow or throttled GPU" if job.gpu else "a busy or shared CPU core, a sleep or stall in its loop")
            + ")")


def topology(job: Job) -> dict:
    """The mapping tries, for GPU jobs only (a CPU job has no NVLink to map onto)."""
    if not job.gpu:
        return {}
    return {"group": "map group {group} onto one NVLink domain (TP inside a node, DP across nodes)",
            "link": "check which link the group uses (nvidia-smi topo -m) and NCCL's choice (NCCL_DEBUG=INFO)"}
