"""Shared by the CPU and the CUDA test of the grouped expert GEMMs: one chunk's experts through
torch._grouped_mm and through the per-expert loop, forward and backward, on the same inputs."""

import torch

from overlapkit.expert_parallel import experts as X

SIZES = [40, 0, 72, 16]  # an expert that receives no rows among them
HIDDEN, FFN = 32, 48


def compare(device: str, dtype: torch.dtype, add_output_bias: bool = True) -> tuple[float, bool]:
    """(largest relative error over y, dx and the four gradients; whether the grouped path ran)."""
    g = torch.Generator().manual_seed(0)
    e, m = len(SIZES), sum(SIZES)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    x, w1, b1, w2, b2 = rand(m, HIDDEN), rand(e, FFN, HIDDEN), rand(e, FFN), rand(e, HIDDEN, FFN), rand(e, HIDDEN)
    dy = rand(m, HIDDEN)
    assert X._grouped(x, w1, w2, b1, b2), "the grouped path is not chosen for these operands"
    y, pre = X.experts_forward(x, SIZES, w1, b1, w2, b2, add_output_bias)
    y_ref, pre_ref = X._loop_forward(x, SIZES, w1, b1, w2, b2, add_output_bias)
    grads = [torch.zeros(s, device=device, dtype=dtype) for s in (w1.shape, b1.shape, w2.shape, b2.shape)]
    grads_ref = [t.clone() for t in grads]
    dx = X.experts_backward(dy, x, pre, SIZES, w1, w2, grads)
    dx_ref = X._loop_backward(dy, x, pre_ref, SIZES, w1, w2, grads_ref)
    ran = X._key(x, w1) not in X._GROUPED_BROKEN
    errs = [((a.double() - b.double()).norm() / b.double().norm()).item()
            for a, b in zip([y, dx, *grads], [y_ref, dx_ref, *grads_ref])]
    # The expert with no rows: no gradient, on both paths.
    assert all(float(t[1].abs().max()) == 0.0 for t in grads)
    return max(errs), ran
