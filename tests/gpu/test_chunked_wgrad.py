"""The chunked wgrad's fp32 accumulation on CUDA: one GEMM per chunk adding into the fp32 sum.

`addmm_accumulate_` uses torch's addmm with out_dtype where the build has it (probed once);
either way the sum of bf16 chunk products must equal the fp32 product within bf16 input
rounding, and the fused form must not round each chunk's product to bf16 first.
"""

import torch

from overlapkit.tensor_parallel import precision


def test_fp32_accumulation_of_bf16_chunk_products_matches_fp32():
    torch.manual_seed(0)
    a = torch.randn(256, 1024, device="cuda").bfloat16()
    b = torch.randn(1024, 384, device="cuda").bfloat16()
    ref = a.double() @ b.double()
    acc = torch.zeros(256, 384, device="cuda")
    for k in range(8):
        rows = slice(k * 128, (k + 1) * 128)
        precision.addmm_accumulate_(acc, a[:, rows], b[rows])
    err = ((acc.double() - ref).norm() / ref.norm()).item()
    fused = precision._FUSED_ACCUMULATE.get((acc.device, torch.bfloat16, torch.float32))
    # fp32 accumulation of exact bf16 inputs: ~1e-6; a bf16-rounded product per chunk: ~1e-3.
    assert err <= (1e-5 if fused else 5e-3), f"fused={fused}: rel err {err:.2e}"
    print(f"fused accumulation available: {fused}")
