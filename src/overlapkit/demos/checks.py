"""How the demos compare a parallel run with its single-process twin."""

from __future__ import annotations


def max_errors(pairs) -> tuple[float, float]:
    """(max absolute, max relative) error over (local, reference) tensor pairs, in fp32."""
    abs_err = rel_err = 0.0
    for local, ref in pairs:
        diff = (local.detach().float() - ref.detach().float()).abs().max().item()
        abs_err = max(abs_err, diff)
        rel_err = max(rel_err, diff / max(ref.detach().float().abs().max().item(), 1e-12))
    return abs_err, rel_err
