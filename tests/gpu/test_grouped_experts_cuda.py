"""The experts' grouped GEMMs on CUDA against the per-expert loop (bf16 and fp32)."""

import pytest
import torch

from expert_parallel.grouped_cases import compare  # tests/ is on sys.path (conftest)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_grouped_experts_match_the_loop_on_cuda(dtype, tol):
    err, ran = compare("cuda", dtype)
    print(f"{dtype}: grouped ran {ran}, max rel err {err:.2e}")
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability() >= (9, 0):
        assert ran, "torch._grouped_mm refused bf16 on this Hopper GPU: the loop ran instead"
    assert err <= tol, err
