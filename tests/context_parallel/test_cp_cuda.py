"""On a CUDA device (skipped without one): the ring's flash path (bf16) and math path (fp32) at cp = 1 against
scaled_dot_product_attention, output and q/k/v grads, so the GPU benchmark times a ring that computes the right thing."""

import pytest
import torch
import torch.nn.functional as F

from overlapkit.context_parallel import ContextParallelConfig, ring_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype,kernel,tol", [(torch.bfloat16, "flash", 2e-2), (torch.float32, "math", 1e-5)])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_cp1_on_cuda_equals_sdpa(dtype, kernel, tol, causal):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 256, 64, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(2, 2, 256, 64, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    dout = torch.randn_like(q)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=causal, enable_gqa=True)
    ref.backward(dout.double())
    mine = [t.detach().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*mine, None, causal=causal, config=ContextParallelConfig(kernel=kernel))
    out.backward(dout)
    for a, b in [(out, ref)] + [(m.grad, r.grad) for m, r in zip(mine, ref_in)]:
        err = ((a.double() - b).abs().max() / b.abs().max()).item()
        assert err <= tol, err
