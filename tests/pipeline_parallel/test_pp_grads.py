"""Loss and every gradient of the pipeline equal one process on the same micro-batches: pp = 2, 3, 4,
v = 1 and 2, m >= pp, overlap_p2p on and off, with DP=2 (also with a ShardedOptimizer, whose
parameter gathers land during the next step's forwards) and TP=2 (sequence parallel) inside stages;
and bad inputs fail on every rank, naming the values, before any transfer.

Everything runs in one world of 4 gloo ranks (spawning is most of the cost on a shared machine):
pp=4; pp=3 on ranks 0-2; two pp=2 pipelines side by side; pp=2 x dp=2; pp=2 x tp=2.
"""

import copy
import datetime
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed import distributed
from overlapkit.runtime.agreement import RankMismatchError
from overlapkit.runtime.groups import ParallelGroups
from overlapkit.models import GPT
from overlapkit.pipeline_parallel import PipelineConfig, PipelineEngine, sequential_chunks
from overlapkit.models import gpt_chunks
from pp_cases import Layout, data, layout_of, loss_fn, pipeline_case, sharded_case, tiny_gpt

TOL = 1e-5

# (schedule, v, m, overlap_p2p, layers, steps)
PP2 = [("1f1b", 1, 2, True, 2, 2), ("1f1b", 1, 3, False, 2, 1), ("interleaved-1f1b", 2, 2, True, 4, 2),
       ("interleaved-1f1b", 2, 4, False, 4, 1), ("gpipe", 1, 2, True, 2, 1), ("gpipe", 2, 3, False, 4, 1)]
PP3 = [("1f1b", 1, 3, True, 3, 1), ("1f1b", 1, 4, False, 3, 1), ("interleaved-1f1b", 2, 3, True, 6, 1),
       ("interleaved-1f1b", 2, 6, False, 7, 1)]
PP4 = [("1f1b", 1, 4, True, 4, 1), ("1f1b", 1, 5, False, 4, 1), ("interleaved-1f1b", 2, 4, True, 8, 1),
       ("interleaved-1f1b", 2, 4, False, 8, 1), ("gpipe", 1, 4, True, 5, 1)]
PP2_DP2 = [("1f1b", 1, 2, True, 2, 2), ("interleaved-1f1b", 2, 4, False, 4, 1)]
PP2_TP2 = [("1f1b", 1, 3, True, 2, 1), ("interleaved-1f1b", 2, 2, False, 4, 1), ("gpipe", 1, 2, True, 3, 1)]


def _run(layout, cases, label):
    return {(label,) + c: pipeline_case(layout, *c[:5], steps=c[5]) for c in cases}


def _widths_change_between_stages(group):
    """A plain nn.Sequential whose width changes at every cut: the engine learns each chunk's output shape."""
    torch.manual_seed(0)
    widths = [3, 6, 2, 5, 4, 3]
    ref = nn.Sequential(*[nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in zip(widths, widths[1:])])
    chunks, _ = sequential_chunks(copy.deepcopy(ref), dist.get_world_size(group), dist.get_rank(group))
    m = 3
    x, y = torch.randn(m * 2, 3), torch.randn(m * 2, 3)
    mse = lambda out, t: ((out - t) ** 2).mean()  # noqa: E731
    loss = PipelineEngine(chunks, group, PipelineConfig("1f1b", m, broadcast_loss=True), mse).step(x, y)
    ref_loss = sum(mse(ref(a), b) / m for a, b in zip(x.chunk(m), y.chunk(m)))
    ref_loss.backward()
    refs = dict(ref.named_parameters())
    errs = [((loss - ref_loss).abs() / ref_loss.abs()).item()]
    errs += [((p.grad - refs[n].grad).norm() / refs[n].grad.norm()).item() for c in chunks
             for n, p in c.named_parameters()]
    return max(errs)


def _error(fn):
    try:
        fn()
    except (ValueError, RankMismatchError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _bad_inputs(groups: ParallelGroups) -> dict:
    rank, pp = groups.pp_rank, groups.sizes.pp
    model = tiny_gpt(1, 4)
    chunks, _ = gpt_chunks(model, pp, rank)
    engine = PipelineEngine(chunks, groups.pp, PipelineConfig("1f1b", 4), loss_fn)
    idx, tgt = data(model.cfg, 1, 4, mb=2)
    out = {
        "m too small": _error(lambda: PipelineEngine(chunks, groups.pp, PipelineConfig("1f1b", 3), loss_fn)),
        "m differs": _error(lambda: PipelineEngine(chunks, groups.pp, PipelineConfig("1f1b", 4 + (rank == 2)),
                                                   loss_fn)),
        "cannot split": _error(lambda: gpt_chunks(tiny_gpt(1, 3), pp, rank)),
        # The last stage's targets have 1 row per micro-batch, the first stage's inputs 2.
        "shapes differ": _error(lambda: engine.step(idx[0], tgt[0][:4])),
        "too few micro-batches": _error(lambda: engine.step(list(idx[0].chunk(4))[:3], tgt[0])),
        "no inputs": _error(lambda: engine.step(None, tgt[0])),
    }
    loss = engine.step(idx[0], tgt[0])  # nothing half-sent is left behind: the next step runs
    out["still runs"] = loss is not None if rank == pp - 1 else loss is None
    return out


@distributed(world_size=4, timeout_s=60)
def _world4():
    timeout = datetime.timedelta(seconds=60)
    grads = {}
    groups = ParallelGroups.build(pp=4)
    grads.update(_run(layout_of(groups), PP4, "pp4"))
    bad = _bad_inputs(groups)
    sub3 = dist.new_group([0, 1, 2], timeout=timeout)
    if dist.get_rank() < 3:
        grads.update(_run(Layout(pp=sub3), PP3, "pp3"))
    two = ParallelGroups.build(pp=2, dp=2)
    grads.update(_run(layout_of(two, dp=False), PP2, "pp2"))  # two independent pp=2 pipelines
    grads["pp2 sequential, widths change"] = _widths_change_between_stages(two.pp)
    grads.update(_run(layout_of(two), PP2_DP2, "pp2 dp2"))
    grads[("pp2 dp2 ShardedOptimizer", "1f1b")] = sharded_case(layout_of(two), "1f1b", 1, 2, 2)
    grads[("pp2 dp2 ShardedOptimizer", "interleaved-1f1b")] = sharded_case(layout_of(two), "interleaved-1f1b", 2, 2, 4)
    grads.update(_run(layout_of(ParallelGroups.build(pp=2, tp=2)), PP2_TP2, "pp2 tp2"))
    return {"grads": grads, "bad": bad}


@functools.cache
def _results():
    return _world4()


def test_every_schedule_pp_v_dp_tp_matches_one_process():
    for rank, res in enumerate(_results()):
        assert len(res["grads"]) == (23 if rank < 3 else 19)  # rank 3 is not in the pp=3 pipeline
        for case, err in res["grads"].items():
            assert err <= TOL, (rank, case, err)


@pytest.mark.parametrize("check, needles", [
    ("m too small", ["ValueError", "microbatches=3 < pp=4"]),
    ("m differs", ["RankMismatchError", "microbatches differs", "rank 2: 5", "rank 0: 4"]),
    ("cannot split", ["cannot split 3 layers into pp=4"]),
    ("shapes differ", ["RankMismatchError", "[2, 4]", "[1, 4]", "batch size"]),
    ("too few micro-batches", ["RankMismatchError", "3 micro-batches of inputs for microbatches=4"]),
    ("no inputs", ["RankMismatchError", "first pipeline rank was given no inputs"]),
])
def test_bad_input_fails_on_every_rank_naming_the_values(check, needles):
    messages = [res["bad"][check] for res in _results()]
    assert len(set(messages)) == 1, messages  # the same error on every rank
    for needle in needles:
        assert needle in messages[0], messages[0]


def test_after_refused_steps_the_pipeline_still_runs():
    assert all(res["bad"]["still runs"] for res in _results())
