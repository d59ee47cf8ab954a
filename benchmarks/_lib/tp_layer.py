"""The TP GEMMs of a Llama layer and the layer of TP+SP linears that the TP benchmarks time
(tp_overlap, tp_host_cost, tp_chunk_profile, tp_step_gaps)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from overlapkit.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from _lib.presets import MODELS

CPU_SHRINK = 32
"""On CPU every width is divided by this and tokens are 384 (divisible by 2·ws for ws ≤ 4)."""


def tp_gemms(model: str, shrink: int) -> list[tuple[str, str, int, int]]:
    """(name, 'ag' or 'rs', K, N) of the full (unsplit) TP GEMMs of one layer."""
    m = MODELS[model]
    h, ffn = m["hidden"], m["ffn"]
    qkv = (m["heads"] + 2 * m["kv_heads"]) * h // m["heads"]
    full = [("qkv", "ag", h, qkv), ("proj", "rs", h, h), ("fc1", "ag", h, 2 * ffn), ("fc2", "rs", ffn, h)]
    return [(n, kind, k // shrink, nn // shrink) for n, kind, k, nn in full]


class TPLayer(torch.nn.Module):
    """The TP+SP linears of one Llama layer: qkv → proj (+x), fc1 → SwiGLU → fc2 (+h).

    Attention itself is left out (it has no TP communication); the rank's query heads stand in
    for its output. Full widths are scaled so that each rank holds the TP=`tp` slice.
    """

    def __init__(self, model: str, shrink: int, tp: int, group, device, dtype, **overlap) -> None:
        super().__init__()
        ws = dist.get_world_size(group)
        (_, _, h, qkv), _, (_, _, _, ffn2), _ = tp_gemms(model, shrink)
        kw = dict(bias=False, sequence_parallel=True, device=device, dtype=dtype, **overlap)
        self.h_rank = h // tp
        self.qkv = ColumnParallelLinear(h, qkv * ws // tp, group, name="qkv", **kw)
        self.proj = RowParallelLinear(h * ws // tp, h, group, name="proj", **kw)
        self.fc1 = ColumnParallelLinear(h, ffn2 * ws // tp, group, name="fc1", **kw)
        self.fc2 = RowParallelLinear(ffn2 // 2 * ws // tp, h, group, name="fc2", **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.qkv(x)[..., :self.h_rank].contiguous()) + x
        gate, up = self.fc1(h).chunk(2, dim=-1)
        return self.fc2(torch.nn.functional.silu(gate) * up) + h
