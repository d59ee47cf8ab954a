"""The fused all-reduce + residual add + norm equals the unfused add and norm bit for bit.

One process (nothing to reduce): `all_reduce_add_norm` is exactly `norm(residual + x + bias)` for
torch's RMSNorm, LayerNorm and transformers' Llama RMSNorm, fp32 and bf16. Two gloo ranks: exactly
the group's all-reduce followed by the same add and norm. The config refuses bad values by name.
"""

import pytest
import torch

from distributed import distributed
from overlapkit.inference import InferenceConfig, all_reduce_add_norm, reduce_partial


def _norms(h: int):
    torch.manual_seed(1)
    norms = [torch.nn.RMSNorm(h, eps=1e-6), torch.nn.LayerNorm(h)]
    try:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
        norms.append(LlamaRMSNorm(h))
    except ImportError:
        pass
    for n in norms:
        with torch.no_grad():
            n.weight.uniform_(0.5, 1.5)
    return norms


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_process_equals_add_then_norm(dtype):
    g = torch.Generator().manual_seed(0)
    x, residual, bias = (torch.randn(shape, generator=g).to(dtype) for shape in ((3, 1, 16), (3, 1, 16), (16,)))
    for norm in _norms(16):
        norm = norm.to(dtype)
        with torch.no_grad():
            normed, h = all_reduce_add_norm(x, residual, norm, None, bias=bias)
            assert torch.equal(h, residual + (x + bias))
            assert torch.equal(normed, norm(residual + (x + bias))), type(norm).__name__
            none, h2 = all_reduce_add_norm(x, residual, None, None)
            assert none is None and torch.equal(h2, residual + x)


@distributed(world_size=2)
def _two_ranks():
    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(10 + rank)  # each rank holds its own partial sums
    x = torch.randn(4, 1, 16, generator=g)
    residual = torch.randn(4, 1, 16, generator=torch.Generator().manual_seed(7))
    group = torch.distributed.group.WORLD
    out = []
    for norm in _norms(16):
        with torch.no_grad():
            normed, h = all_reduce_add_norm(x, residual, norm, group)
            summed = x.clone()
            torch.distributed.all_reduce(summed)
            out.append(torch.equal(h, residual + summed) and torch.equal(normed, norm(residual + summed)))
    out.append(torch.equal(reduce_partial(x, group, "t"), summed))
    return out


def test_two_ranks_equal_all_reduce_then_add_then_norm():
    for rank, ok in enumerate(_two_ranks()):
        assert all(ok), f"rank {rank}: {ok}"


def test_config_refuses_bad_values_by_name():
    with pytest.raises(ValueError, match="one_shot_max_bytes"):
        InferenceConfig(one_shot_max_bytes=-1)
    with pytest.raises(ValueError, match="symm_mem"):
        InferenceConfig(symm_mem="yes")
    assert InferenceConfig(one_shot_max_bytes=0).one_shot_max_bytes == 0
