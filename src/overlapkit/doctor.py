"""`overlapkit doctor`: what this machine offers for overlap, and the settings that decide it.

Prints torch / CUDA / NCCL versions, the GPUs and their peer-access matrix (the symm_mem
transport and NVLink copies need it), the backends torch.distributed has, and
CUDA_DEVICE_MAX_CONNECTIONS with what it means for each kind of overlap.
"""

from __future__ import annotations

import os
import platform

import torch
import torch.distributed as dist
from torch.torch_version import TorchVersion

from .runtime.comm import max_connections_meaning


def facts() -> dict:
    """Everything doctor prints, as a dict (also used by tests and benchmarks' metadata)."""
    info: dict = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "nccl": None,
        "backends": {name: getattr(dist, f"is_{name}_available", lambda: False)() for name in ("gloo", "nccl", "mpi")},
        "symmetric_memory_api": _has_symm_mem(),
        "gpus": [],
        "peer_access": [],
        "env": {k: os.environ.get(k) for k in ("CUDA_DEVICE_MAX_CONNECTIONS", "NCCL_NVLS_ENABLE",
                                                "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_P2P_DISABLE")},
    }
    if torch.cuda.is_available():
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as e:  # a CPU-only or ROCm build: report, don't fail
            info["nccl"] = f"unavailable ({e})"
        n = torch.cuda.device_count()
        for i in range(n):
            p = torch.cuda.get_device_properties(i)
            info["gpus"].append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                                 "sms": p.multi_processor_count, "capability": f"{p.major}.{p.minor}"})
        info["peer_access"] = [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(n)] for i in range(n)]
    return info


def _has_symm_mem() -> bool:
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except Exception:
        return False
    return hasattr(torch.ops, "symm_mem") and hasattr(torch.ops.symm_mem, "fused_all_gather_matmul")


def advice(info: dict) -> list[str]:
    """Plain-language consequences of the facts."""
    out = []
    value = info["env"]["CUDA_DEVICE_MAX_CONNECTIONS"]
    out.append(f"CUDA_DEVICE_MAX_CONNECTIONS={value}: {max_connections_meaning(value)}.")
    out.append("  Tensor-parallel overlap (overlap='bulk') on GPUs before Blackwell wants 1: the collective "
               "issued before a GEMM then starts before it.")
    out.append("  FSDP and multi-stream data-parallel overlap want it unset or > 1: with one queue, "
               "TP and DP communication serialize.")
    if not info["cuda_available"]:
        out.append("No CUDA device: every engine runs on CPU over gloo (correctness, not speed); "
                   "the symm_mem transport needs CUDA peer access.")
    elif len(info["gpus"]) == 1:
        out.append("One GPU: NCCL refuses two ranks on one GPU, so multi-rank overlap needs more GPUs; "
                   "world size 1 and the chunked-GEMM cost can still be measured.")
    elif not all(all(row) for row in info["peer_access"]):
        out.append("Some GPU pairs lack peer access: the symm_mem transport cannot run between them; use transport='p2p'.")
    if info["env"]["NCCL_NVLS_ENABLE"] not in (None, "0"):
        out.append("NCCL_NVLS_ENABLE is on: NVLink multicast is in use.")
    if TorchVersion(info["torch"]) < (2, 13):
        # Seen under 2.11, gone under 2.13 (docs/data_parallel.md): the single-tensor path's ops carry the step's
        # scalars, which key FakeTensor's process-wide dispatch cache, so every step propagates them again.
        out.append(f"torch {info['torch']} is older than 2.13: an optimizer on its default single-tensor path over "
                   "DTensor parameters (fully_shard, FSDP2, parallelize) re-propagates each op every step under "
                   "torch 2.11 (~2.4 ms a parameter shape, and a cache that grows every step); pass foreach=True "
                   "or fused=True, with overlapkit.optim_param_groups where plain and DTensor parameters mix.")
    return out


def print_doctor(info: dict | None = None) -> None:
    info = info or facts()
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # the GPU image may lack rich: plain text then
        for k, v in info.items():
            print(f"{k}: {v}")
        print("\n".join(advice(info)))
        return
    console = Console()
    t = Table(title="overlapkit doctor", show_header=False)
    t.add_column("what")
    t.add_column("value")
    for key in ("python", "torch", "cuda_runtime", "nccl", "cuda_available", "symmetric_memory_api"):
        t.add_row(key, str(info[key]))
    t.add_row("backends", ", ".join(k for k, v in info["backends"].items() if v))
    for k, v in info["env"].items():
        t.add_row(k, "unset" if v is None else v)
    for g in info["gpus"]:
        t.add_row(f"cuda:{g['index']}", f"{g['name']}, {g['memory_gib']} GiB, {g['sms']} SMs, sm_{g['capability']}")
    console.print(t)
    if info["peer_access"]:
        p = Table(title="peer access (row can read column)")
        p.add_column("")
        for j in range(len(info["peer_access"])):
            p.add_column(str(j))
        for i, row in enumerate(info["peer_access"]):
            p.add_row(str(i), *("yes" if v else "no" for v in row))
        console.print(p)
    for line in advice(info):
        console.print(line)


def print_probe(rows: list[dict]) -> None:
    """The overlap probe's rows (see overlapkit.probe), with what they mean."""
    lines = [f"{r['transfer']}: GEMM {r['gemm_ms']:.2f} ms, transfer {r['transfer_ms']:.2f} ms, together "
             f"{r['both_ms']:.2f} ms -> {r['hidden_fraction']:.2f} of the shorter hidden: {r['verdict']}"
             for r in rows]
    lines.append("Copy-engine transfers can hide behind GEMMs; transfers that run as SM kernels compete with "
                 "them. This is measured with this process's CUDA_DEVICE_MAX_CONNECTIONS.")
    try:
        from rich.console import Console
    except ImportError:
        print("\n".join(lines))
        return
    console = Console()
    console.print("[bold]overlap probe[/bold] (one GPU, a bf16 GEMM beside a transfer on a side stream)")
    for line in lines:
        console.print(line)
