"""The earlier spellings of "how much to overlap" (and of the TP mesh) still work: each warns once per process
with a DeprecationWarning naming the new spelling, and builds exactly what the new spelling builds."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch import nn

from distributed import distributed
from overlapkit.pipeline_parallel import PipelineConfig
from overlapkit.runtime import state
from overlapkit.vocabulary import ENGINE_SWITCH, RENAMED


def _deprecations(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]


def test_pipeline_overlap_p2p_is_overlap_bulk_or_none_and_warns_once():
    state.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old_off, old_on = PipelineConfig(overlap_p2p=False), PipelineConfig(overlap_p2p=True)
    assert old_off == PipelineConfig(overlap="none") and old_on == PipelineConfig(overlap="bulk") == PipelineConfig()
    assert old_off.overlap_p2p is False and old_on.overlap_p2p is True  # the old field still reads back
    (message,) = _deprecations(caught)  # once, for two uses
    assert "overlap_p2p" in message and 'overlap="bulk" | "none"' in message
    assert dataclasses.replace(old_off, microbatches=8).overlap == "none"  # replace() keeps the setting, silently
    with pytest.raises(ValueError, match=r"PipelineConfig.overlap='pipelined' is not one of \('none', 'bulk'\)"):
        PipelineConfig(overlap="pipelined")
    with pytest.raises(ValueError, match="overlap_p2p must be True or False"):
        PipelineConfig(overlap_p2p="yes")


def test_every_engine_switch_is_spelled_overlap():
    assert all("overlap=" in switch for switch in ENGINE_SWITCH.values())
    assert all("overlap" in new or "tp_mesh" in new for new in RENAMED.values())


def _blocks() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.ModuleList([nn.Linear(4, 4) for _ in range(3)]))


@distributed(world_size=2)
def _old_and_new_spellings():
    import torch.distributed as dist

    from overlapkit.data_parallel import DataParallel, ShardedOptimizer, fully_shard, prefetch_plan
    from overlapkit.expert_parallel import MoE
    from overlapkit.tensor_parallel import tp_mesh, tp_mesh_and_group

    state.reset()
    out = {}

    def plan(**kw):
        p = prefetch_plan(fully_shard(_blocks(), None, **kw))
        return p.mode, p.forward_depth, p.backward_depth

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["fsdp"] = [(plan(prefetch=p), plan(**new)) for p, new in (
            (2, {"overlap": "bulk", "prefetch_depth": 2}), ((1, 2), {"overlap": "bulk", "prefetch_depth": (1, 2)}),
            (0, {"overlap": "none"}), ("auto", {}))]
        moe = lambda **kw: MoE(8, 16, 4, 1, None, **kw).config  # noqa: E731
        out["moe"] = [(moe(chunks=c), moe(**new)) for c, new in (
            (2, {"overlap": "pipelined", "chunks": 2}), ("ranks", {"overlap": "pipelined", "chunks": "ranks"}),
            (1, {"overlap": "none"}), ("auto", {}))]
        dp = lambda o: DataParallel(nn.Linear(4, 4), None, overlap=o).config  # noqa: E731
        out["dp"] = [(dp(False), dp("none")), (dp(True), dp("bulk"))]
        zero = lambda **kw: ShardedOptimizer(DataParallel(nn.Linear(4, 4), None), torch.optim.SGD, None, lr=0.1,  # noqa: E731
                                             **kw).overlap_param_gather
        out["zero"] = [(zero(overlap_param_gather=False), zero(overlap="none")),
                       (zero(overlap_param_gather=True), zero())]
        old_mesh, old_group = tp_mesh_and_group(dist.group.WORLD)
        tp_mesh_and_group(dist.group.WORLD)
        new_mesh = tp_mesh(dist.group.WORLD)
        out["tp_mesh"] = [(old_mesh.mesh.tolist(), new_mesh.mesh.tolist()),
                          (dist.get_process_group_ranks(old_group), dist.get_process_group_ranks(new_mesh.get_group()))]
    out["warned"] = _deprecations(caught)
    with pytest.raises(ValueError, match="prefetch_depth=0 must be an integer >= 1"):
        fully_shard(_blocks(), None, overlap="bulk", prefetch_depth=0)
    with pytest.raises(ValueError, match="pass one or the other"):
        fully_shard(_blocks(), None, overlap="none", prefetch=2)
    with pytest.raises(ValueError, match="chunks=3 is for overlap='pipelined'"):
        MoE(8, 16, 4, 1, None, overlap="auto", chunks=3)
    with pytest.raises(ValueError, match="under overlap='pipelined' must be an integer >= 2"):
        MoE(8, 16, 4, 1, None, overlap="pipelined", chunks=1)
    return out


def test_old_spellings_build_what_the_new_ones_build_and_warn_once():
    for out in _old_and_new_spellings():
        for engine in ("fsdp", "moe", "dp", "zero", "tp_mesh"):
            for old, new in out[engine]:
                assert old == new, (engine, old, new)
        warned = out["warned"]
        for old in ("fully_shard(prefetch=...)", "MoE(chunks=...) without overlap=", "DataParallel(overlap=True | False)",
                    "ShardedOptimizer(overlap_param_gather=...)", "tensor_parallel.tp_mesh_and_group(x)"):
            assert sum(m.startswith(old + " is deprecated") for m in warned) == 1, (old, warned)
        assert len(warned) == 5, warned
