"""Ring attention in one process (cp = 1), its block plan, and its argument checks."""

import pytest
import torch

from cp_cases import TOL
from overlapkit.context_parallel import ContextParallelConfig
from overlapkit.context_parallel.ring import Call, block_plan


def test_ring_attention_cp1_is_plain_attention():
    # No group: the ring is one block, the fixed-cost path the GPU benchmark times at world size 1.
    from cp_cases import attention_errors
    for causal in (True, False):
        for overlap in ("auto", "bulk"):
            cfg = ContextParallelConfig(kernel="math", overlap=overlap)
            assert attention_errors(None, causal=causal, heads=4, kv_heads=2, config=cfg) <= TOL


def test_zigzag_plan_skips_future_blocks_and_balances_work():
    size, chunk = 4, 3
    work = []
    for rank in range(size):
        pairs = 0
        for step in range(size):
            calls = block_plan(rank, (rank - step) % size, size, "zigzag", chunk, causal=True)
            if step == 0:
                assert calls == [Call(0, 2 * chunk, 0, 2 * chunk, True)]  # own block: one causal call
            else:
                # Another rank's block: half of the 2x2 chunk pairs are in the future and skipped.
                assert len(calls) == 1 and not calls[0].causal
            pairs += sum((c.q1 - c.q0) * (c.k1 - c.k0) for c in calls)
        work.append(pairs)
    assert work == [(2 * chunk) ** 2 + (size - 1) * 2 * chunk * chunk] * size  # the same on every rank
    # Contiguous under a causal mask: the future is skipped, so rank 0 computes only its own block.
    assert [block_plan(0, s, 4, "contiguous", 2, True) for s in (1, 2, 3)] == [[], [], []]


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="overlap='chunked'"):
        ContextParallelConfig(overlap="chunked")
    assert ContextParallelConfig(overlap="bulk").overlap == "bulk"  # the all-gather schedule
    with pytest.raises(ValueError, match="prefetch=0"):
        ContextParallelConfig(overlap="bulk", prefetch=0)
    with pytest.raises(ValueError, match="layout='halves'"):
        ContextParallelConfig(layout="halves")
    with pytest.raises(ValueError, match="kernel='fast'"):
        ContextParallelConfig(kernel="fast")


def test_shapes_checked():
    from overlapkit.context_parallel import ring_attention
    q = torch.randn(1, 3, 4, 8)
    with pytest.raises(ValueError, match="not a multiple of 2 key/value heads"):
        ring_attention(q, torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), None)


def test_shard_positions_unshard_agree():
    from overlapkit.context_parallel import chunks_of, positions, shard, unshard
    assert chunks_of(1, 4, "zigzag") == (1, 6) and chunks_of(1, 4, "contiguous") == (1,)
    x = torch.arange(24).view(1, 24, 1).float()
    for layout in ("zigzag", "contiguous"):
        for size in (1, 2, 3, 4):
            parts = [shard(x, 1, r, size, layout) for r in range(size)]
            for r, part in enumerate(parts):  # the positions of a rank's tokens are the tokens it got
                assert torch.equal(positions(24, r, size, layout), part.view(-1).long())
            assert torch.equal(unshard(parts, 1, layout), x)
    with pytest.raises(ValueError, match="sequence length 10 does not split over cp=3 with layout='zigzag'"):
        positions(10, 0, 3, "zigzag")
