"""Bulk overlap is measured, not assumed: the recorder shows backward's collectives running under its GEMMs.

Rank 1 joins every backward collective late (a slowed-down transfer), so on rank 0 each
collective is surely still in flight when the GEMM issued after it runs: with bulk overlap
the two intersect on rank 0's timeline, with none they never do. A pipelined column layer
over p2p runs the same backward (chunks only in its forward), so it is held to the same. No wall-clock ratio is
asserted, so load on the machine cannot flip the result.
"""

import time

import pytest
import torch
import torch.distributed as dist

from distributed import distributed
from overlapkit.runtime import comm
from overlapkit.tensor_parallel.layers import ColumnParallelLinear
from overlapkit.timeline import record


def _overlap_ms(a, b) -> float:
    return max(0.0, min(a.end_ms, b.end_ms) - max(a.start_ms, b.start_ms))


def _late(fn, delay_s: float):
    def issue_late(*args, **kwargs):
        time.sleep(delay_s)
        return fn(*args, **kwargs)
    return issue_late


@distributed(world_size=2)
def _backward_spans(overlap: str):
    if dist.get_rank() == 1:
        comm.all_gather = _late(comm.all_gather, 0.2)
        comm.reduce_scatter = _late(comm.reduce_scatter, 0.2)
    torch.manual_seed(0)
    layer = ColumnParallelLinear(512, 1024, dist.group.WORLD, sequence_parallel=True, overlap=overlap, name="fc")
    x = torch.randn(256, 512, requires_grad=True)
    y = layer(x)
    with record() as rec:
        y.backward(torch.randn_like(y))
    by_name = {}
    for s in rec.spans:
        by_name.setdefault((s.name, s.kind), s)
    ag = by_name[("fc.bwd", "tp_all_gather")]
    rs = by_name[("fc.bwd", "tp_reduce_scatter")]
    dgrad = by_name[("fc.bwd.dgrad", "compute")]
    wgrad = by_name[("fc.bwd.wgrad", "compute")]
    return dict(ag_under_dgrad=_overlap_ms(ag, dgrad), rs_under_wgrad=_overlap_ms(rs, wgrad),
                ag_issued_first=ag.start_ms <= dgrad.start_ms, rs_issued_first=rs.start_ms <= wgrad.start_ms)


@pytest.mark.parametrize("overlap", ["bulk", "pipelined"])
def test_bulk_backward_runs_collectives_under_gemms(overlap):
    # pipelined over p2p: the column backward is Megatron's bulk order (only the forward is chunked)
    for r in _backward_spans(overlap)[:1]:
        assert r["ag_issued_first"] and r["rs_issued_first"], r
        assert r["ag_under_dgrad"] > 0.0, r  # the re-gather was still running when dgrad computed
        assert r["rs_under_wgrad"] > 0.0, r


def test_none_backward_serializes():
    for r in _backward_spans("none")[:1]:
        assert r["ag_under_dgrad"] == 0.0 and r["rs_under_wgrad"] == 0.0, r
