"""DataParallel on a transformers MoE model whose experts are split over ep: each expert's gradient reduced over the ranks that hold a copy of it, no more.

`overlapkit.init(ep=..)`, `parallelize(model, groups.mesh)`, then `DataParallel(model, groups.dp)` with
nothing else called: dense gradients averaged over dp in buckets during backward, expert gradients
summed over their copies (the expert-data group) and divided by dp. Each dp rank on its own batch,
two optimizer-free steps (the second after `zero_grad`): the loss and every gradient within 1e-5 of one
process, also across two micro-batches the first under `no_sync`; the last layer's expert all-reduce is
issued while the first layer's expert backward still runs.
Layouts: ep 2 in dp 2 (one copy of each expert), ep 2 in dp 4 (two copies), and ep 2 x tp 2 with
sequence parallelism (dp 2). A data-parallel group the experts' groups do not tile is refused, naming it, and
so are `fully_shard` over dp and ShardedOptimizer on the experts (not yet: they would copy and average
different experts). A
DataParallel's DCP checkpoint saved at ep 2 x tp 2 resumes at ep 2 in dp 4 with every parameter equal.
"""

import copy

import pytest

from distributed import distributed

pytest.importorskip("transformers")

import hf_moe_cases  # noqa: E402  (pytest puts this folder on sys.path; spawned ranks inherit it)

TOL = 1e-5


def _errors(family: str, groups, spans: list | None = None) -> dict:
    import torch
    import torch.distributed as dist

    import overlapkit
    from overlapkit.data_parallel import DataParallel

    ref = hf_moe_cases.build(family)
    model = DataParallel(overlapkit.parallelize(copy.deepcopy(ref), groups.mesh), groups.dp, bucket_mb=1)
    dp, errs = groups.sizes.dp, {}
    for step in range(2):
        model.zero_grad()
        ref.zero_grad()
        ids = torch.randint(3, 64, (2 * dp, 8), generator=torch.Generator().manual_seed(10 + step))
        mine = ids.chunk(dp)[groups.dp_rank]
        with overlapkit.timeline.record() as rec:
            out = model(input_ids=mine, labels=mine)
            out.loss.backward()
        if spans is not None:
            spans[:] = [(s.kind, s.name, s.start_ms, s.end_ms) for s in rec.spans]
        ref_loss = 0.0
        for part in ids.chunk(dp):
            r = ref(input_ids=part, labels=part)
            (r.loss / dp).backward()
            ref_loss += r.loss.item() / dp
        loss = torch.tensor([out.loss.item()], dtype=torch.float64)
        dist.all_reduce(loss)
        errs[f"loss{step}"] = abs(loss.item() / dist.get_world_size() - ref_loss) / abs(ref_loss)
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            want = ref_params[name].grad
            errs[f"{name}@{step}"] = ((grad - want).norm() / want.norm().clamp_min(1e-6)).item()
    return errs


def _dcp_resume(directory: str) -> dict:
    """Saved wrapped at ep 2 x tp 2 (dp 2, one copy of each expert), resumed wrapped at ep 2 in dp 4 (two copies)."""
    import torch
    import torch.distributed.checkpoint as dcp

    import overlapkit
    from overlapkit.data_parallel import DataParallel

    first = overlapkit.init(ep=2, tp=2)
    saved = DataParallel(overlapkit.parallelize(hf_moe_cases.build("qwen3_moe", seed=0), first.mesh), first.dp)
    dcp.save(saved.state_dict(), checkpoint_id=directory)
    groups = overlapkit.init(ep=2)
    resumed = DataParallel(overlapkit.parallelize(hf_moe_cases.build("qwen3_moe", seed=5), groups.mesh), groups.dp)
    state = resumed.state_dict()
    dcp.load(state, checkpoint_id=directory)
    resumed.load_state_dict(state)
    want = {n: p.full_tensor() for n, p in saved.named_parameters()}
    got = {n: p.full_tensor() for n, p in resumed.named_parameters()}
    return {"differs": sorted(n for n in want if not torch.equal(want[n], got[n])),
            "names": sorted(want) == sorted(got)}


@distributed(world_size=4, timeout_s=480)
def _world4(directory: str):
    import torch
    import torch.distributed as dist

    import overlapkit
    from overlapkit.data_parallel import DataParallel, fully_shard

    out = {"ep2 in dp4": _errors("qwen3_moe", overlapkit.init(ep=2), spans := []),
           "ep2 x tp2, SP": _errors("mixtral", overlapkit.init(ep=2, tp=2))}
    # the last layer's experts all-reduce (module 1) is issued before the first layer's expert backward ends
    first_layer_bwd = max(e for k, n, _, e in spans
                          if k == "compute" and n.startswith("model.layers.0.mlp.experts.bwd"))
    issued = next(s for _, n, s, _ in spans if n == "expert_grads[1]")
    out["overlap"] = {"issued before": float(issued < first_layer_bwd)}
    dcp = _dcp_resume(directory)
    groups = overlapkit.init(ep=2, tp=2)
    model = overlapkit.parallelize(hf_moe_cases.build("qwen3_moe"), groups.mesh)
    try:
        DataParallel(model, dist.group.WORLD)  # the world: the experts' copies are in dp, not here
    except ValueError as e:
        out["refused"] = str(e)
    try:
        fully_shard(model, groups.mesh)
    except ValueError as e:
        out["fully_shard"] = str(e)
    from overlapkit.data_parallel import ShardedOptimizer

    try:
        ShardedOptimizer(DataParallel(model, groups.dp), torch.optim.AdamW, groups.dp)
    except ValueError as e:
        out["sharded optimizer"] = str(e)
    return out, dcp


def _no_sync_errors(groups) -> dict:
    """Two micro-batches, the first under no_sync: every gradient is that of their summed losses."""
    import torch

    import overlapkit
    from overlapkit.data_parallel import DataParallel

    ref = hf_moe_cases.build("mixtral")
    model = DataParallel(overlapkit.parallelize(copy.deepcopy(ref), groups.mesh), groups.dp)
    dp = groups.sizes.dp
    batches = [torch.randint(3, 64, (2 * dp, 8), generator=torch.Generator().manual_seed(20 + i)) for i in range(2)]
    with model.no_sync():
        mine = batches[0].chunk(dp)[groups.dp_rank]
        model(input_ids=mine, labels=mine).loss.backward()
    mine = batches[1].chunk(dp)[groups.dp_rank]
    model(input_ids=mine, labels=mine).loss.backward()
    for ids in batches:
        for part in ids.chunk(dp):
            (ref(input_ids=part, labels=part).loss / dp).backward()
    ref_params = dict(ref.named_parameters())
    return {n: ((p.grad.full_tensor() - ref_params[n].grad).norm() / ref_params[n].grad.norm()).item()
            for n, p in model.named_parameters()}


@distributed(world_size=2, timeout_s=300)
def _world2():
    import overlapkit

    groups = overlapkit.init(ep=2)
    return {"ep2 in dp2": _errors("qwen2_moe", groups), "no_sync": _no_sync_errors(groups)}


def _check(out):
    for case, errs in out.items():
        if case in ("refused", "fully_shard", "sharded optimizer", "overlap"):
            continue
        worst = max(errs, key=errs.get)
        assert errs[worst] <= TOL, (case, worst, errs[worst])


def test_ep2_in_dp2_one_copy_of_each_expert_and_no_sync_accumulation():
    for out in _world2():
        _check(out)


def test_ep2_in_dp4_and_with_tp2_experts_reduced_over_their_copies_and_dcp_resume_at_another_layout(tmp_path):
    for out, dcp in _world4(str(tmp_path / "ckpt")):
        assert dcp["names"] and dcp["differs"] == [], dcp
        assert out["overlap"]["issued before"] == 1.0, out["overlap"]
        _check(out)
        assert "does not tile the data-parallel group of 4" in out["refused"], out.get("refused")
        assert "expert-parallel" in out["fully_shard"] and "DataParallel" in out["fully_shard"], out.get("fully_shard")
        assert "does not shard yet" in out["sharded optimizer"], out.get("sharded optimizer")
