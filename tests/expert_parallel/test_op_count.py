"""How many aten ops one MoE call dispatches at one rank, on the GPUs' path (grouped GEMMs; switched on
for CPU here): a host-bound layer's cost, so a change that adds ops shows here rather than only on the GPU.

The bound is what the path needs, counted op by op (fp32, one chunk, top-2), plus 4 for the ways torch
versions decompose an op differently (2.11 on the GPU image, 2.13 here). Dropless forward, 26 kernels:
router 5 (gate mm, softmax with the fp32 upcast inside, top-k, the chosen logits gathered and their
softmax: the renormalised weights); the counts
3 (a one, zeros, scatter_add), shared by the loss and the plan; the loss 4 (probs.sum, the counts' cast,
dot, scale); the plan 3 (one sort, the groups' ends by cumsum, each row's token); the experts 8 (gather
the rows, grouped GEMM, bias gather and add, gelu, grouped GEMM, bias gather and add); the rows back to
their slots 1; the weighted sum over the k slots 2. Before these were counted the same forward launched
37 kernels (counting twice, casting, a repeat_interleave for the experts the sort already gives) and the
padded one 59.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from overlapkit.expert_parallel import MoE
from overlapkit.expert_parallel import experts as X

_spec = importlib.util.spec_from_file_location(
    "ops", Path(__file__).resolve().parents[2] / "benchmarks" / "_lib" / "ops.py")
ops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ops)

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")

MARGIN = 4
BOUNDS = {  # (forward kernels, backward kernels) the path needs; see the docstring for the forward's
    "dropless": (26, 22),
    "padded": (40, 24),
}


@pytest.mark.parametrize("path", list(BOUNDS))
def test_moe_dispatches_at_most_the_ops_its_path_needs(path, monkeypatch):
    monkeypatch.setattr(X, "GROUPED_DEVICES", {"cpu"})
    torch.manual_seed(0)
    kw = dict(capacity_factor=1.25, pad_to_capacity=True) if path == "padded" else {}
    moe = MoE(16, 16, 8, 2, None, chunks=1, **kw)
    x, dy = torch.randn(32, 16), torch.randn(32, 16)
    counted = ops.layer_ops(moe, x, dy)
    fwd, bwd = BOUNDS[path]
    assert counted["fwd_grad"]["kernels"] <= fwd + MARGIN, counted
    assert counted["bwd"]["kernels"] <= bwd + MARGIN, counted
    # Views and allocations cost a dispatch each too: not more than the kernels again.
    assert counted["fwd_grad"]["ops"] <= 2 * (fwd + MARGIN), counted


def test_the_counter_counts_each_op_once():
    _, counted = ops.count_ops(lambda: torch.ones(3).add(1).view(3, 1).sum())
    assert ops.summary(counted) == dict(ops=4, kernels=3)


def test_shape_constants_are_made_once_per_shape_and_change_no_plan():
    from overlapkit.expert_parallel.dispatch import plan_dispatch
    experts = torch.randint(0, 8, (32, 2), generator=torch.Generator().manual_seed(0))
    cache = {}
    cached = plan_dispatch(experts, 8, 3, None, None, "m", cache=cache)
    fresh = plan_dispatch(experts, 8, 3, None, None, "m")
    assert torch.equal(cached.row_assignment, fresh.row_assignment) and cached.chunk_rows == fresh.chunk_rows
    assert [g.sizes for g in cached.groups] == [g.sizes for g in fresh.groups]
    (made,) = cache.values()
    plan_dispatch(experts, 8, 3, None, None, "m", cache=cache)
    assert next(iter(cache.values())) is made  # the second call made nothing
    plan_dispatch(experts[:20], 8, 3, None, None, "m", cache=cache)
    assert len(cache) == 2  # a new token count: its own constant
