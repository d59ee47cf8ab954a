"""TP+SP composed with data parallelism: DataParallel and ShardedOptimizer over a sequence-parallel GPT.

Layer norms and row biases hold per-token-shard gradients under SP; with a sharded optimizer
they must be summed over TP before the DP reduce-scatter consumes them, which
DataParallel(sequence_parallel_group=tp) does bucket by bucket in backward.
"""

import copy

import torch

from distributed import distributed
from overlapkit.data_parallel import DataParallel, ShardedOptimizer
from overlapkit.runtime.groups import ParallelGroups
from overlapkit.models import GPT, GPTConfig, expected_local, lm_loss, parallelize
from overlapkit.tensor_parallel.layers import allreduce_sequence_parallel_grads


def _setup(bucket_mb: float):
    groups = ParallelGroups.build(tp=2, dp=2)
    cfg = GPTConfig(vocab_size=16, seq_len=8, hidden=16, num_heads=2, ffn_hidden=16, num_layers=2)
    torch.manual_seed(5)
    ref = GPT(cfg)
    model = parallelize(copy.deepcopy(ref), groups, sequence_parallel=True, overlap="bulk")
    model = DataParallel(model, groups.dp, bucket_mb=bucket_mb, first_bucket_mb=bucket_mb,
                         sequence_parallel_group=groups.tp)
    gen = torch.Generator().manual_seed(9)
    data = [(torch.randint(0, 16, (4, 8), generator=gen), torch.randint(0, 16, (4, 8), generator=gen))
            for _ in range(2)]
    rows = slice(2 * groups.dp_rank, 2 * groups.dp_rank + 2)
    return groups, ref, model, data, rows


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@distributed(world_size=4)
def _grads(bucket_mb):
    groups, ref, model, data, rows = _setup(bucket_mb)
    idx, tgt = data[0]
    lm_loss(model(idx[rows]), tgt[rows]).backward()
    lm_loss(ref(idx), tgt).backward()
    err = max(_rel(local, full) for _, local, full in expected_local(model, ref, "grad"))
    try:
        allreduce_sequence_parallel_grads(model, groups.tp)
        refused = None
    except ValueError as e:
        refused = str(e)
    return err, refused


def test_dataparallel_sums_sp_grads_in_backward():
    for bucket_mb in (1e-4, 25.0):  # one parameter per bucket, and one bucket for all
        for err, refused in _grads(bucket_mb):
            assert err <= 1e-5, (bucket_mb, err)
            assert "already sums sequence-parallel gradients" in refused


@distributed(world_size=4)
def _sharded_adamw():
    groups, ref, model, data, rows = _setup(1e-3)
    # The key part of the qkv bias has a mathematically zero gradient (softmax ignores a shift
    # shared by all keys), so both runs see only rounding noise there; Adam's m/sqrt(v) would
    # turn that noise into full-size, run-dependent steps. eps keeps noise-level gradients inert.
    opt = ShardedOptimizer(model, torch.optim.AdamW, groups.dp, lr=1e-2, eps=1e-4)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-4)
    for idx, tgt in data:
        opt.zero_grad()
        lm_loss(model(idx[rows]), tgt[rows]).backward()
        opt.step()
        ref_opt.zero_grad()
        lm_loss(ref(idx), tgt).backward()
        ref_opt.step()
    model(data[0][0][rows])  # the next forward waits for the overlapped parameter gathers
    return max(_rel(local, full) for _, local, full in expected_local(model, ref, "data"))


def test_sharded_optimizer_with_sequence_parallel_matches_adamw():
    for err in _sharded_adamw():
        assert err <= 1e-5, err
