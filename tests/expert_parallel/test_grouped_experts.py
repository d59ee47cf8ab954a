"""The experts' grouped GEMMs (torch._grouped_mm, one kernel for all local experts) against the
per-expert loop they replace, in fp32 on CPU: forward, dx and every weight and bias gradient.
(GPUs take the grouped path; on CPU it is switched on here to check its formulas.)"""

import pytest
import torch

from overlapkit.expert_parallel import experts as X

from grouped_cases import compare

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")


@pytest.mark.parametrize("add_output_bias", [True, False])
def test_grouped_experts_match_the_loop_in_fp32(add_output_bias, monkeypatch):
    # CPU keeps the loop (its grouped op is slower); here the grouped formulas are checked on it.
    monkeypatch.setattr(X, "GROUPED_DEVICES", {"cpu", "cuda"})
    err, ran = compare("cpu", torch.float32, add_output_bias)
    assert ran, "torch._grouped_mm refused fp32 on CPU: the loop ran instead"
    assert err <= 1e-5, err


def test_cpu_autocast_and_empty_chunks_take_the_loop(monkeypatch):
    x, w = torch.randn(8, 4), torch.randn(2, 6, 4)
    assert not X._grouped(x, w)  # CPU: the loop is faster there
    monkeypatch.setattr(X, "GROUPED_DEVICES", {"cpu"})
    assert X._grouped(x, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not X._grouped(x, w)
    assert not X._grouped(x[:0], w)
    assert not X._grouped(x, w.double())
