"""What the pipelined engine does in time (from its recorded spans), and how it refuses bad arguments.

Ordering: rank 0 enters late, so every chunk that has to come from it arrives late; the other
ranks' recorded spans must show the local chunk's GEMM before the last arrival (all-gather),
and GEMMs of later chunks running while an early partial is still in flight (reduce-scatter).
A gather-then-GEMM or GEMM-then-scatter schedule fails both. Errors: every rank raises the
same message, before any communication, and the group is still usable afterwards.
"""

import functools
import time

import torch
import torch.distributed as dist

from distributed import distributed
from overlapkit import timeline
from overlapkit.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from overlapkit.tensor_parallel.pipelined import (TransportUnavailable, all_gather_matmul,
                                                  column_parallel_linear_pipelined, matmul_reduce_scatter)

LATE_S = 0.5
"""How late rank 0 enters: far above scheduling noise on a loaded machine."""


def _late_rank0_record(fn):
    dist.barrier()
    if dist.get_rank() == 0:
        time.sleep(LATE_S)
    with timeline.record() as rec:
        fn()
    return [(s.kind, s.name, s.start_ms, s.end_ms) for s in rec.spans]


def _ordering(ws: int) -> dict:
    group = dist.group.WORLD
    r = dist.get_rank()
    x, w = torch.randn(2, 3), torch.randn(4, 3)
    with torch.no_grad():
        ag = _late_rank0_record(lambda: all_gather_matmul(x, [w], group, chunks=2 * ws))
        rs = _late_rank0_record(lambda: matmul_reduce_scatter(torch.randn(2 * ws, 3), w, group, chunks=2 * ws))
    return {"rank": r, "ag": ag, "rs": rs}


def _errors(ws: int) -> list:
    group = dist.group.WORLD
    x, w = torch.randn(2, 3), torch.randn(4, 3)
    cases = [
        lambda: all_gather_matmul(x, [w], group, chunks=ws + 1),
        lambda: all_gather_matmul(x, [w], group, chunks=3 * ws),  # 2 rows per rank do not split in 3
        lambda: all_gather_matmul(x, [w], group, chunks=True),
        lambda: matmul_reduce_scatter(torch.randn(2 * ws + 1, 3), w, group),
        lambda: matmul_reduce_scatter(torch.randn(2 * ws, 3), w, group, chunks=0),
        lambda: all_gather_matmul(x, [w], group, transport="nvshmem"),
        lambda: all_gather_matmul(x, [w], group, gather_dim=1),
        lambda: all_gather_matmul(x, [torch.randn(4, 5)], group),
        lambda: all_gather_matmul(x, [w], group, transport="symm_mem"),
        lambda: matmul_reduce_scatter(torch.randn(2 * ws, 3), w, group, transport="symm_mem"),
        lambda: all_gather_matmul(x, [w.requires_grad_()], group),
        lambda: column_parallel_linear_pipelined(x, w, torch.zeros(5), group),
        lambda: ColumnParallelLinear(3, 4 * ws, group, sequence_parallel=False, overlap="pipelined"),
        lambda: RowParallelLinear(3 * ws, 4, group, sequence_parallel=True, overlap="pipelined", chunks=ws + 1),
        lambda: RowParallelLinear(3 * ws, 4, group, sequence_parallel=True, overlap="none", transport="symm_mem"),
    ]
    out = []
    for case in cases:
        try:
            case()
            out.append(None)
        except (ValueError, RuntimeError) as e:
            out.append((type(e).__name__, str(e)))
    # Still in step: a good call after all those refusals completes on every rank.
    (y,) = all_gather_matmul(torch.full((1, 1), float(dist.get_rank())), [torch.ones(1, 1)], group)
    return out + [y.flatten().tolist()]


@distributed(world_size=3)
def _run3():
    return {"order": _ordering(3), "errors": _errors(3)}


@functools.cache
def results() -> list:
    return _run3()


def test_local_gemm_starts_before_the_last_chunk_arrives():
    late_ranks = [res["order"] for res in results() if res["order"]["rank"] != 0]
    assert len(late_ranks) == 2
    for o in late_ranks:
        gemms = [s for s in o["ag"] if s[0] == "compute"]
        transfers = [s for s in o["ag"] if s[0] == "tp_all_gather"]
        assert len(gemms) == 6 and len(transfers) == 4  # chunks = 2·ws: (ws - 1)·2 transfers
        first_gemm_start = min(s[2] for s in gemms)
        last_arrival = max(s[3] for s in transfers)
        assert first_gemm_start < last_arrival - 0.4 * LATE_S * 1e3, (o["rank"], gemms, transfers)


def test_partials_are_sent_while_later_chunks_compute():
    for o in (res["order"] for res in results() if res["order"]["rank"] != 0):
        gemms = [s for s in o["rs"] if s[0] == "compute"]
        transfers = [s for s in o["rs"] if s[0] == "tp_reduce_scatter"]
        assert len(gemms) == 6 and len(transfers) == 4
        # Rank 0 is the peer of some step; that step's transfer waits for it while GEMMs go on.
        slow = max(transfers, key=lambda s: s[3] - s[2])
        under = [g for g in gemms if slow[2] < g[2] < slow[3] - 0.4 * LATE_S * 1e3]
        assert under, (o["rank"], slow, gemms)


def test_bad_arguments_fail_alike_on_every_rank_before_communicating():
    per_rank = [res["errors"] for res in results()]
    assert per_rank[0] == per_rank[1] == per_rank[2]
    m = per_rank[0]
    allowed = "allowed are None (one chunk per rank, 3) or one of [3, 6]"
    assert m[0] == ("ValueError", f"chunks=4 is not allowed with world size 3 and 2 rows per rank along dim 0: {allowed}")
    assert m[1] == ("ValueError", f"chunks=9 is not allowed with world size 3 and 2 rows per rank along dim 0: {allowed}")
    assert m[2][0] == "ValueError" and "chunks=True is not allowed" in m[2][1]
    assert m[3] == ("ValueError", "x.shape[0]=7 (scatter_dim) is not divisible by the world size 3")
    assert m[4][0] == "ValueError" and "chunks=0 is not allowed" in m[4][1]
    assert m[5] == ("ValueError", "transport='nvshmem' is not one of ('p2p', 'symm_mem')")
    assert m[6][0] == "ValueError" and "gather_dim=1 must name a dim of the 2-D input other than the last" in m[6][1]
    assert m[7][0] == "ValueError" and "weights[0] must be [out, 3]" in m[7][1]
    for i in (8, 9):  # symm_mem on CPU tensors over gloo: refused with the reason, no fallback
        assert m[i] == ("TransportUnavailable", "transport='symm_mem' cannot run here: the tensors are on cpu; "
                        "symmetric memory is CUDA device memory. transport='p2p' (batched send/recv) runs on NCCL and gloo.")
    assert issubclass(TransportUnavailable, RuntimeError)
    assert m[10][0] == "RuntimeError" and "not differentiable" in m[10][1]
    assert m[11][0] == "ValueError" and "bias must be [4]" in m[11][1]
    assert m[12] == ("ValueError", "overlap='pipelined' chunks the sequence-parallel all-gather/reduce-scatter: "
                     "it needs sequence_parallel=True")
    assert m[13] == ("ValueError", "chunks=4 must be None (one chunk per rank) or a positive multiple of the "
                     "tensor-parallel size 3")
    assert m[14][0] == "ValueError" and "apply to overlap='pipelined' or 'auto' only" in m[14][1]
    assert m[15] == [0.0, 1.0, 2.0]
