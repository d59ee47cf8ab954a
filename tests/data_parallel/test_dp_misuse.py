"""DataParallel and ShardedOptimizer misuse (issue 11): no silent wrong gradient, every rank raises.

group=None means the default group, as in torch.distributed; parameters re-typed after
wrapping, a module wrapped twice and transposed shapes across ranks are refused with a message
naming the parameter; every buffer (bool and complex too) starts as rank 0's; under
ShardedOptimizer `.grad` holds the true average on this rank's shard and `clip_grad_norm_`
gives the norm over all ranks; an absurd bucket size names its field.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from distributed import distributed
from dp_cases import data, grads, local, mlp, worst
from overlapkit.data_parallel import DataParallel, DataParallelConfig, ShardedOptimizer

TOL = 1e-5


def _attempt(fn):
    try:
        fn()
        return None
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"


def _cases() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {}
    x, y = data(world)
    ref = mlp()
    F.mse_loss(ref(x), y).backward()

    m = DataParallel(mlp(), None)  # torch's meaning: the default group
    F.mse_loss(m(local(x, rank, world)), local(y, rank, world)).backward()
    out["group=None vs single process"] = worst(grads(m.module), grads(ref))

    def retyped():
        m = DataParallel(mlp(), dist.group.WORLD)
        m.module.double()
        m(local(x, rank, world).double()).sum().backward()
    out["double after wrapping"] = _attempt(retyped)

    def moved():
        m = DataParallel(mlp(), dist.group.WORLD)
        m.module.to(torch.bfloat16)
        m(local(x, rank, world).bfloat16()).sum().backward()
    out["to(bfloat16) after wrapping"] = _attempt(moved)

    def twice():
        inner = mlp()
        DataParallel(inner, dist.group.WORLD)
        DataParallel(inner, dist.group.WORLD)
    out["wrapped twice"] = _attempt(twice)
    out["wrapped in a wrapper"] = _attempt(lambda: DataParallel(DataParallel(mlp(), dist.group.WORLD),
                                                                dist.group.WORLD))

    def transposed():
        torch.manual_seed(0)
        DataParallel(nn.Linear(6, 4, bias=False) if rank == 0 else nn.Linear(4, 6, bias=False), dist.group.WORLD)
    out["transposed shapes"] = _attempt(transposed)

    class Buffers(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("flag", torch.tensor([rank == 1, rank == 0]))
            self.register_buffer("z", torch.full((2,), complex(rank, -rank)))
            self.register_buffer("count", torch.tensor(rank + 7))
    b = DataParallel(Buffers(), dist.group.WORLD).module
    out["buffers"] = (b.flag.tolist(), b.z.tolist(), b.count.item())

    # ShardedOptimizer: .grad on this rank's shard, and the norm over all ranks
    ref = mlp()
    F.mse_loss(ref(x), y).backward()
    true_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05).item()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_opt.step()
    m = DataParallel(mlp(), dist.group.WORLD, first_bucket_mb=1e-9, bucket_mb=1e-9)
    opt = ShardedOptimizer(m, torch.optim.SGD, dist.group.WORLD, lr=0.5)
    F.mse_loss(m(local(x, rank, world)), local(y, rank, world)).backward()
    ref_grads = [p.grad for p in mlp_grads(x, y)]
    buf = m.sync.buffer
    want = torch.zeros_like(buf.data)  # the true averaged gradient, laid out like the buffer
    for q, g in zip(m.module.parameters(), ref_grads):
        buf.view(q, want).copy_(g)
    shard_err = max(((buf.data[lo:hi] - want[lo:hi]).norm() / want[lo:hi].norm().clamp_min(1e-30)).item()
                    for lo, hi in opt._ranges)
    out["sharded .grad on own shard vs true average"] = shard_err
    out["clip_grad_norm_ total"] = opt.clip_grad_norm_(0.05).item()
    out["true norm"] = true_norm
    opt.step()
    opt.finish_param_gather()
    out["clipped step vs single process"] = worst(list(m.module.parameters()), list(ref.parameters()))
    return out


def mlp_grads(x, y):
    ref = mlp()
    F.mse_loss(ref(x), y).backward()
    return list(ref.parameters())


@distributed(world_size=2, timeout_s=45.0)
def _two():
    return _cases()


@functools.cache
def results() -> list[dict]:
    return _two()


def test_group_none_is_the_default_group():
    for r in results():
        assert r["group=None vs single process"] <= TOL, r


@pytest.mark.parametrize("case", ["double after wrapping", "to(bfloat16) after wrapping"])
def test_parameters_retyped_after_wrapping_are_refused(case):
    for r in results():
        msg = r[case]
        assert msg is not None and msg.startswith("ValueError") and "0.weight" in msg, msg
        assert "torch.float32" in msg and "build DataParallel after" in msg, msg


@pytest.mark.parametrize("case", ["wrapped twice", "wrapped in a wrapper"])
def test_wrapping_twice_is_refused(case):
    for r in results():
        msg = r[case]
        assert msg is not None and "already" in msg and "0.weight" in msg, msg


def test_transposed_shapes_are_refused_on_every_rank():
    out = results()
    for rank, r in enumerate(out):
        msg = r["transposed shapes"]
        assert msg is not None and "weight" in msg, msg
        assert ("(4, 6)" if rank == 0 else "(6, 4)") in msg, msg


def test_every_buffer_starts_as_rank_zeros():
    for r in results():
        assert r["buffers"] == ([False, True], [0j, 0j], 7), r


def test_sharded_grad_and_clip_norm_over_all_ranks():
    for r in results():
        assert r["sharded .grad on own shard vs true average"] <= TOL, r
        assert abs(r["clip_grad_norm_ total"] - r["true norm"]) <= TOL * r["true norm"], r
        assert r["clipped step vs single process"] <= TOL, r


@pytest.mark.parametrize("field", ["bucket_mb", "first_bucket_mb"])
def test_huge_bucket_names_its_field(field):
    with pytest.raises(ValueError, match=rf"DataParallelConfig.{field} must be .* <= 1048576 \(1 TiB\), got 100000000000000.0"):
        DataParallelConfig(**{field: 1e14})
    with pytest.raises(ValueError, match=rf"{field}"):
        DataParallel(mlp(), None, **{field: 1e14})


@distributed(world_size=2, timeout_s=30)
def _wrap_experts():
    from overlapkit.data_parallel import DataParallel
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    for p in model[1].parameters():
        p.expert_parallel = True  # what the MoE experts carry: each EP rank holds other experts
    try:
        DataParallel(model, None)
    except ValueError as e:
        return str(e)
    return "wrapped"


def test_expert_parallel_parameters_are_refused_on_every_rank():
    out = _wrap_experts()
    # plain tensors (overlapkit's own MoE layer): no EP mesh to find the copies from; a transformers model's
    # experts, DTensors on their EP mesh, are reduced over their copies (tests/models/test_hf_moe_data_parallel.py)
    assert len(set(out)) == 1 and "expert-parallel parameter '1.weight'" in out[0], out
    assert "average_data_parallel_grads" in out[0], out
