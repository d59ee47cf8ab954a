"""The ring's CUDA blocks (cuDNN where the build runs it, else flash) merged over two key/value
blocks, forward and backward, against scaled_dot_product_attention on the whole sequence: the
log-sum-exp the kernel returns must be the one the merge assumes, and its backward must take
the merged output and lse. At cp = 1 the ring makes a single call and checks neither."""

import pytest
import torch
import torch.nn.functional as F

from overlapkit.context_parallel import kernels as K


@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2)])
def test_two_blocks_merged_equal_sdpa(heads, kv_heads):
    g = torch.Generator(device="cuda").manual_seed(0)
    b, s, d = 2, 512, 128
    q = torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, kv_heads, s, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    dout = torch.randn_like(q)
    scale = d ** -0.5
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, enable_gqa=True)  # not causal: both blocks full
    ref.backward(dout.double())
    half = s // 2
    blocks = [(slice(0, half)), slice(half, s)]
    out = lse = None
    rests = []
    for kb in blocks:
        o, l, rest = K.block_forward(q, k[:, :, kb], v[:, :, kb], False, scale, "flash")
        rests.append(rest)
        if out is None:
            out, lse = o, l
        else:
            K.merge(out, lse, o, l)
    print("kernel used:", rests[0][0] if rests[0] else None, "cudnn refused:", K._CUDNN_BROKEN)
    dq = torch.zeros(q.shape, device="cuda")
    dk, dv = torch.zeros(k.shape, device="cuda"), torch.zeros(v.shape, device="cuda")
    for kb, rest in zip(blocks, rests):
        dq_b, dk_b, dv_b = K.block_backward(dout, q, k[:, :, kb], v[:, :, kb], out, lse, False, scale, "flash", rest)
        dq += dq_b
        dk[:, :, kb] += dk_b
        dv[:, :, kb] += dv_b
    for name, a, r in [("out", out, ref), ("dq", dq, ref_in[0].grad), ("dk", dk, ref_in[1].grad), ("dv", dv, ref_in[2].grad)]:
        err = ((a.double() - r).abs().max() / r.abs().max()).item()
        assert err <= 2e-2, (name, err)
    if torch.cuda.get_device_capability() >= (9, 0):
        assert rests[0][0] == "cudnn", "cuDNN attention refused on this Hopper GPU: the flash kernel ran"
