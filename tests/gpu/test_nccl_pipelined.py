"""Pipelined TP on CUDA over NCCL, one rank per visible GPU, both transports; symm_mem's refusals.

At world size 1 (one GPU) no chunk moves, but every stream, event, symmetric-memory
rendezvous, barrier and buffer view of the pipelines runs, so the torch at hand is checked
against the API the engine uses. With several GPUs the same tests pull from real peers.
"""

import pytest
import torch
import torch.distributed as dist

from distributed import distributed
from gpu.test_nccl_layers import _on_cuda
from overlapkit import timeline
from overlapkit.tensor_parallel.pipelined import TransportUnavailable, all_gather_matmul, matmul_reduce_scatter
from tensor_parallel.test_pipelined import RTOL, check_bf16_sums_in_fp32, check_functions, check_layers


@distributed(world_size=None, backend="nccl", timeout_s=120)
def _pipelined_nccl(transport):
    group = dist.group.WORLD
    return {"functions": _on_cuda(check_functions, group, transport),
            "layers": _on_cuda(check_layers, group, transport),
            "bf16": _on_cuda(check_bf16_sums_in_fp32, group, transport),
            "spans": _on_cuda(_recorded, group, transport)}


def _recorded(group, transport):
    """Kinds and streams of what the engine recorded for one AG+GEMM and one GEMM+RS (CUDA events)."""
    ws = dist.get_world_size(group)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with torch.no_grad(), timeline.record(device=x.device) as rec:
        all_gather_matmul(x, [w], group, chunks=2 * ws, transport=transport)
        matmul_reduce_scatter(torch.randn(4 * ws, 8), w, group, chunks=2 * ws, transport=transport)
    return [(s.kind, s.stream, s.duration_ms >= 0) for s in rec.spans]


@pytest.mark.parametrize("transport", ["p2p", "symm_mem"])
def test_pipelined_on_nccl(transport):
    per_rank = _pipelined_nccl(transport)
    ws = len(per_rank)
    for res in per_rank:
        for part in ("functions", "layers"):
            bad = {k: v for k, v in res[part].items() if not v <= RTOL}
            assert len(res[part]) >= 6 and not bad, (transport, part, bad)
        b = res["bf16"]
        assert b["value"] == b["expected"] and b["dtype"] == "torch.bfloat16", b
        gemms = [s for s in res["spans"] if s[0] == "compute"]
        moves = [s for s in res["spans"] if s[0] in ("tp_all_gather", "tp_reduce_scatter")]
        assert len(gemms) == 4 * ws and all(s[2] for s in res["spans"])
        assert len(moves) == 4 * (ws - 1)


@distributed(world_size=None, backend="nccl", timeout_s=60)
def _symm_mem_refusals():
    dev = torch.device("cuda", torch.cuda.current_device())
    gloo = dist.new_group(backend="gloo")
    cases = [
        lambda: all_gather_matmul(torch.randn(2, 3), [torch.randn(4, 3)], dist.group.WORLD, transport="symm_mem"),
        lambda: all_gather_matmul(torch.randn(2, 3, device=dev), [torch.randn(4, 3, device=dev)], gloo,
                                  transport="symm_mem"),
        lambda: matmul_reduce_scatter(torch.randn(2 * dist.get_world_size(), 3, device=dev),
                                      torch.randn(4, 3, device=dev), gloo, transport="symm_mem"),
    ]
    out = []
    for case in cases:
        try:
            case()
            out.append(None)
        except TransportUnavailable as e:
            out.append(str(e))
    dist.barrier()  # every rank got here: a refusal never leaves a rank in a collective
    return out


def test_symm_mem_refuses_cpu_and_gloo_with_the_reason():
    per_rank = _symm_mem_refusals()
    assert all(m == per_rank[0] for m in per_rank)
    cpu, gloo_ag, gloo_rs = per_rank[0]
    assert cpu is not None and "the tensors are on cpu" in cpu
    assert gloo_ag is not None and "the group's backend is gloo" in gloo_ag
    assert gloo_rs == gloo_ag
    assert all("transport='p2p'" in m for m in per_rank[0])
