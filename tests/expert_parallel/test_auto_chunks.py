"""chunks="auto": the chunk counts are timed on the first calls, the slowest rank's times decide on every
rank, the kept count is the one that runs, and nothing of the trials is left on the hot path afterwards.
Also: the capacity-padded path refuses ranks with different token counts."""

import time

import torch
import torch.distributed as dist

from overlapkit.runtime.agreement import RankMismatchError
from overlapkit.expert_parallel import MoE, dispatch
from overlapkit.expert_parallel.config import CHUNK_CANDIDATES
from trial_clock import recorded_without_trial_clock
from worlds import world

# Seconds each candidate is slowed by, per rank, in forward and in backward alike. Rank 0 alone would keep
# 2 chunks and rank 1 alone 4; the slowest rank's times (1: 0.08, ranks: 0.12, 2: 0.1, 4: 0.04, 8: 0.12) keep 4.
DELAYS = ({1: 0.08, "ranks": 0.12, 2: 0.0, 4: 0.04, 8: 0.12}, {1: 0.08, "ranks": 0.12, 2: 0.1, 4: 0.02, 8: 0.12})


def _auto_chunks() -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    moe = MoE(32, 64, 4, 2, dist.group.WORLD, name="moe")  # chunks="auto" is the default
    x = torch.randn(48, 32, requires_grad=True)
    pipeline = dispatch.run_pipeline

    def slowed(rows, plan, *args, **kwargs):
        time.sleep(DELAYS[rank][plan.schedule])
        return pipeline(rows, plan, *args, **kwargs)

    dispatch.run_pipeline = slowed
    try:
        for _ in range(moe.chunk_choice.trial_calls):
            moe(x).sum().backward()
    finally:
        dispatch.run_pipeline = pipeline
    undecided = moe.chunks

    # The deciding call, then two that run as a fixed layer would.
    spans = recorded_without_trial_clock(lambda: moe(x).sum().backward())
    names = [sorted(s.name for s in spans if s.step == k and s.is_comm) for k in (1, 2, 3)]
    computes = sorted(s.name for s in spans if s.step == 3 and s.is_compute)
    return dict(undecided=undecided, decided=moe.chunks, reason=moe.chunk_choice.reason,
                measured=moe.chunk_choice.measured, names=names, computes=computes)


def _padded_needs_equal_tokens() -> str:
    moe = MoE(8, 16, 4, 2, dist.group.WORLD, capacity_factor=1.0, pad_to_capacity=True, chunks=2)
    try:
        moe(torch.randn(5 + dist.get_rank(), 8))
    except RankMismatchError as e:
        return str(e)
    return "no error"


def _fixed_names(chunks: int) -> list[str]:
    out = ["moe.fwd.counts"]
    for phase in ("fwd", "bwd"):
        out += [f"moe.{phase}.{what}[{i}]" for what in ("dispatch", "combine") for i in range(chunks)]
    return sorted(out)


def test_auto_chunks_keeps_the_slowest_ranks_fastest_count_and_leaves_nothing_running():
    for r in world(2):
        a = r["auto"]
        assert a["undecided"] is None, "the trials' calls alone do not decide; the next call does"
        assert a["decided"] == 4, a
        assert set(a["measured"]) == set(CHUNK_CANDIDATES) and "forward+backward" in a["reason"], a
        deciding, steady, again = a["names"]
        # The deciding call adds one all-reduce of the times; afterwards only the layer's own transfers run,
        # those of a layer fixed at 4 chunks, and its experts in 4 chunks.
        assert deciding == sorted(_fixed_names(4) + ["MoE moe chunks.auto"]), deciding
        assert steady == again == _fixed_names(4), steady
        assert a["computes"] == sorted(f"moe.{p}.experts[{i}]" for p in ("fwd", "bwd") for i in range(4))


def test_padded_path_refuses_different_token_counts_on_every_rank():
    for r in world(2):
        assert "tokens differs (rank 0: 5, rank 1: 6)" in r["padded_tokens"], r["padded_tokens"]
