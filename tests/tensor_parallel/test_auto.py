"""overlap='auto': the cost model's choice per GEMM, and the layers stay exact whatever it picks."""

import torch
import torch.distributed as dist

from distributed import distributed
from models.test_parallel_gpt import _gpt_errors
from overlapkit.costmodel import choose_tp_overlap
from overlapkit.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


@distributed(world_size=2)
def _choices():
    g = dist.group.WORLD
    col = ColumnParallelLinear(8, 8, g, sequence_parallel=True, overlap="auto")
    row = RowParallelLinear(8, 8, g, sequence_parallel=True, overlap="auto")
    plain = ColumnParallelLinear(8, 8, g, sequence_parallel=False, overlap="auto")
    big = torch.empty((4096, 8192), device="meta", dtype=torch.bfloat16)     # 8192 gathered tokens
    small = torch.empty((16, 8192), device="meta", dtype=torch.bfloat16)      # 32 gathered tokens
    out = {
        "col_big": col._mode(big.shape, big.dtype, True, 8192, 8192, 14336, "all_gather", 4096),
        "row_big": row._mode(big.shape, big.dtype, True, 8192, 14336, 8192, "reduce_scatter", 4096),
        "col_small": col._mode(small.shape, small.dtype, True, 32, 8192, 14336, "all_gather", 16),
        "plain_big": plain._mode(big.shape, big.dtype, False, 8192, 8192, 14336, "all_gather", 4096),
        "cached": len(col.auto_choices),
    }
    try:
        ColumnParallelLinear(8, 8, g, sequence_parallel=True, overlap="auto", chunks=4)
    except ValueError as e:
        out["chunks_error"] = str(e)
    return out


def test_auto_follows_the_cost_model():
    out = _choices()[0]
    assert out["col_big"] == choose_tp_overlap(8192, 8192, 14336, 2, 2, comm="all_gather")
    assert out["row_big"] == choose_tp_overlap(8192, 14336, 8192, 2, 2, comm="reduce_scatter")
    assert out["col_big"][0] == "pipelined" and out["col_big"][1] % 2 == 0
    assert out["col_small"][0] != "pipelined"          # m = 32: chunking a tiny GEMM only loses
    assert out["plain_big"][0] in ("none", "bulk")     # without SP nothing can be chunked
    assert out["cached"] == 2
    assert "overlap='auto' chooses the chunk count itself" in out["chunks_error"]


@distributed(world_size=3)
def _gpt_auto():
    return {sp: _gpt_errors(sp, "auto") for sp in (False, True)}


def test_auto_gpt_matches_plain():
    for per_rank in _gpt_auto():
        for sp, err in per_rank.items():
            assert err <= 1e-5, (sp, err)
