"""Bad or mismatched MoE arguments fail on every rank naming the values; chunked all-to-alls overlap the experts (from spans)."""

import torch
import torch.distributed as dist

from overlapkit.runtime.agreement import RankMismatchError
from overlapkit.expert_parallel import MoE, MoEConfig
from overlapkit.timeline import record
from worlds import world


def _error(fn) -> str:
    try:
        fn()
    except (ValueError, RankMismatchError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _bad_inputs() -> dict:
    rank, group = dist.get_rank(), dist.group.WORLD
    out = {
        "indivisible": _error(lambda: MoE(8, 16, 3, 1, group)),
        "top_k": _error(lambda: MoE(8, 16, 4, 5, group)),
        "chunks": _error(lambda: MoE(8, 16, 4, 1, group, chunks=0)),
        "chunks_differ": _error(lambda: MoE(8, 16, 4, 1, group, chunks=1 + rank)),
        "top_k_one_rank": _error(lambda: MoE(8, 16, 4, 9 if rank else 1, group)),
    }
    moe = MoE(8, 16, 4, 2, group, chunks=2)
    out["width_differs"] = _error(lambda: moe(torch.randn(3, 8 + rank)))
    out["dtype_differs"] = _error(lambda: moe(torch.randn(3, 8, dtype=torch.float64 if rank else torch.float32)))
    out["still_works"] = tuple(moe(torch.randn(3, 8)).shape)  # the checks leave the ranks in step
    return out


def _overlaps(spans, phase: str) -> list[float]:
    """Per chunk i: how long the combine of chunk i overlapped the experts of chunk i+1, plus how
    long the dispatch of chunk i+1 overlapped the experts of chunk i (ms)."""
    def find(prefix):
        return {int(s.name.rsplit("[", 1)[1][:-1]): s for s in spans if s.name.startswith(prefix)}

    def both(a, b):
        return max(0.0, min(a.end_ms, b.end_ms) - max(a.start_ms, b.start_ms))
    combine, dispatch = find(f"moe.{phase}.combine["), find(f"moe.{phase}.dispatch[")
    experts = find(f"moe.{phase}.experts[")
    return [both(combine[i], experts[i + 1]) + both(dispatch[i + 1], experts[i]) for i in range(len(combine) - 1)]


def _overlap_from_spans(steps: int = 4) -> dict:
    torch.manual_seed(0)
    moe = MoE(256, 512, 4, 2, dist.group.WORLD, chunks=4)
    x = torch.randn(1024, 256, requires_grad=True)
    moe(x).sum().backward()  # warm-up: first-call agreement and allocations
    with record() as rec:
        for _ in range(steps):  # several steps: one rank running ahead of the other can close a window
            rec.next_step()
            moe(x).sum().backward()
    kinds = sorted({s.kind for s in rec.spans if s.is_comm})
    by_step = [[s for s in rec.spans if s.step == k] for k in range(1, steps + 1)]
    return dict(kinds=kinds, fwd=[v for ss in by_step for v in _overlaps(ss, "fwd")],
                bwd=[v for ss in by_step for v in _overlaps(ss, "bwd")], ranks=_by_rank_order())


def _by_rank_order() -> dict:
    """chunks="ranks" at EP 2: the other rank's rows are issued before the own rows' experts start and
    received after they end; the results go back after the other rank's rows were computed."""
    torch.manual_seed(0)
    moe = MoE(64, 128, 4, 2, dist.group.WORLD, chunks="ranks")
    x = torch.randn(256, 64, requires_grad=True)
    moe(x).sum().backward()
    with record() as rec:
        moe(x).sum().backward()
    me, other = dist.get_rank(), 1 - dist.get_rank()
    out = {}
    for phase in ("fwd", "bwd"):
        span = {s.name.split(".", 2)[2]: s for s in rec.spans if s.name.startswith(f"moe.{phase}.")}
        d, c = span["dispatch[1]"], span["combine[1]"]
        own, theirs = span[f"experts[{me}]"], span[f"experts[{other}]"]
        out[phase] = (d.start_ms <= own.start_ms and d.end_ms >= own.end_ms and theirs.start_ms >= own.end_ms
                      and c.start_ms >= theirs.end_ms)
    return out


def test_bad_inputs_fail_on_every_rank_and_chunks_overlap():
    results = world(2)
    bad = [r["bad"] for r in results]
    for rank_bad in bad:
        assert "MoEConfig.num_experts=3 is not divisible by the expert-parallel size 2" in rank_bad["indivisible"]
        assert "MoEConfig.top_k=5 exceeds num_experts=4" in rank_bad["top_k"]
        assert "MoEConfig.chunks must be an integer >= 1, 'ranks' or 'auto', got 0" in rank_bad["chunks"]
        assert "RankMismatchError" in rank_bad["chunks_differ"] and "chunks differs (rank 0: 1, rank 1: 2)" in rank_bad["chunks_differ"]
        assert "top_k differs (rank 0: 1, rank 1: 9)" in rank_bad["top_k_one_rank"]
        assert "width differs (rank 0: 8, rank 1: 9)" in rank_bad["width_differs"]
        assert "dtype differs" in rank_bad["dtype_differs"] and "float64" in rank_bad["dtype_differs"]
        assert rank_bad["still_works"] == (3, 8)
    assert bad[0] == bad[1], "every rank reports the same error"
    for r in results:
        ov = r["overlap"]
        assert ov["kinds"] == ["ep_combine", "ep_dispatch"]
        # Some chunk's transfer ran while the experts computed its neighbour, forward and backward.
        assert max(ov["fwd"]) > 0 and max(ov["bwd"]) > 0, ov
        assert ov["ranks"] == {"fwd": True, "bwd": True}, ov["ranks"]


def test_config_validates_capacity_factor():
    for bad in (0, -1.0, float("inf"), True, "1"):
        try:
            MoEConfig(hidden=8, ffn_hidden=8, num_experts=4, capacity_factor=bad)
        except ValueError as e:
            assert "MoEConfig.capacity_factor" in str(e) and repr(bad) in str(e)
        else:
            raise AssertionError(f"capacity_factor={bad!r} was accepted")
    assert MoEConfig(hidden=8, ffn_hidden=8, num_experts=4, top_k=2, capacity_factor=1.25).capacity(10) == 7
