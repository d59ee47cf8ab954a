"""What a pipeline step costs beyond its schedule's own work: a split forward dispatches the plain forward's
aten ops (no per-op function mode; the modules untouched after it) with the same output and gradients once
its W has run; a steady step compares ranks in one small all-gather (of digests), the full descriptions
travelling only when something is new; under autocast the deferred GEMMs keep the autocast operands."""

from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from distributed import distributed
from overlapkit.models import gpt_chunks, lm_loss
from overlapkit.pipeline_parallel import PipelineConfig, PipelineEngine
from overlapkit.pipeline_parallel.wgrad import LinearRouter, WeightGradStore, emit, split_linears
from overlapkit.runtime.groups import ParallelGroups
from pp_cases import data, tiny_gpt


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _chunk():
    chunks, _ = gpt_chunks(tiny_gpt(1, 4), 2, 1, 1)  # a middle-to-last chunk: blocks, norm, head
    return chunks[0]


def test_a_split_forward_runs_the_plain_forwards_ops_and_its_w_gives_the_same_gradients():
    chunk = _chunk()
    router = LinearRouter([chunk])
    x = torch.randn(2, 4, 8, requires_grad=True)
    with _Ops() as plain:
        ref = chunk(x)
    ref.square().sum().backward()
    want = {n: p.grad.clone() for n, p in chunk.named_parameters()}
    chunk.zero_grad(set_to_none=True)
    store = WeightGradStore()
    xs = x.detach().requires_grad_()
    with _Ops() as split, split_linears(router, store):
        out = chunk(xs)
    assert all("forward" not in m.__dict__ for m in router.forwards), "a module kept the split forward"
    linears = len(router.forwards)
    assert linears >= 4
    extra = split.ops - plain.ops
    assert extra == Counter({"aten.detach.default": linears}), extra  # one detached weight a linear, nothing else
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    out.square().sum().backward()
    assert all(m.weight.grad is None for m in router.forwards), "a weight GEMM ran in B"
    assert len(store) == linears
    emit(store)
    for n, p in chunk.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-6, msg=n)


def test_a_forward_set_on_the_instance_is_left_alone():
    chunk = _chunk()
    router = LinearRouter([chunk])
    first = next(iter(router.forwards))
    wrapped = first.forward

    def theirs(x):  # as a wrapper set on the instance would (accelerate's hooks do)
        return wrapped(x)
    first.forward = theirs
    store = WeightGradStore()
    x = torch.randn(2, 4, 8, requires_grad=True)
    with split_linears(router, store):
        assert first.forward is theirs
        chunk(x).square().sum().backward()
    assert first.forward is theirs and first.weight.grad is not None  # its dW computed in B, its wrapper kept
    assert len(store) == len(router.forwards) - 1


def test_split_under_autocast_keeps_the_autocast_operands():
    chunk = _chunk()
    store = WeightGradStore()
    x = torch.randn(2, 4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), split_linears(LinearRouter([chunk]), store):
        out = chunk(x)
    out.float().square().sum().backward()
    assert store._items and all(dy.dtype == xx.dtype == torch.bfloat16 for _, dy, xx, _ in store._items)
    emit(store)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in chunk.parameters())


@distributed(world_size=2, timeout_s=60)
def _collectives_per_step() -> list[dict]:
    groups = ParallelGroups.build(pp=2)
    rank = groups.pp_rank
    model = tiny_gpt(1, 2)
    chunks, _ = gpt_chunks(model, 2, rank, 1)
    engine = PipelineEngine(chunks, groups.pp, PipelineConfig("1f1b", 2), lm_loss)
    idx, tgt = data(model.cfg, 1, 2)
    calls: Counter = Counter()
    real = {n: getattr(dist, n) for n in ("all_gather", "all_gather_object")}

    def counting(name):
        def call(*a, **k):
            calls[name] += 1
            return real[name](*a, **k)
        return call

    out = []
    try:
        for n in real:
            setattr(dist, n, counting(n))
        for step in range(3):
            calls.clear()
            engine.step(idx[0] if rank == 0 else None, tgt[0] if rank == 1 else None)
            out.append(dict(calls))
    finally:
        for n, f in real.items():
            setattr(dist, n, f)
    return out


def test_a_steady_step_compares_ranks_in_one_small_all_gather():
    for per_step in _collectives_per_step():
        first, *steady = per_step
        assert first.get("all_gather_object") == 1, first  # new: the descriptions travel once
        for s in steady:
            assert s == {"all_gather": 1}, s
