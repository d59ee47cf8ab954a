"""Which attention kernel the ring's block calls should use on a GPU: fwd+bwd of one causal block
(32 query / 8 K/V heads of 128, bf16) through each SDPA backend, and through the aten ops the ring
can call (they return the log-sum-exp it merges with), K/V expanded or GQA-native.

    python benchmarks/probes/cp_kernel_probe.py
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _lib
from _lib.common import add_out_arg, add_smoke_arg, mean_call_ms, out_dir, write_results

aten = torch.ops.aten


def variants(q, k, v, dout):
    g = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scale = q.shape[-1] ** -0.5

    def sdpa(backend, gqa=True):
        def run():
            ql, kl, vl = (t.detach().requires_grad_() for t in (q, k, v))
            with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                o = F.scaled_dot_product_attention(ql, kl if gqa else ke.detach(), vl if gqa else ve.detach(),
                                                   is_causal=True, enable_gqa=gqa)
            o.backward(dout)
        return run

    def flash(kk, vv):
        def run():
            out, lse, cq, ck, mq, mk, seed, off, _ = aten._scaled_dot_product_flash_attention(q, kk, vv, 0.0, True, False, scale=scale)
            aten._scaled_dot_product_flash_attention_backward(dout, q, kk, vv, out, lse, cq, ck, mq, mk, 0.0, True,
                                                               seed, off, scale=scale)
        return run

    def cudnn(kk, vv):
        def run():
            r = aten._scaled_dot_product_cudnn_attention(q, kk, vv, None, True, 0.0, True, False, scale=scale)
            out, lse, cq, ck, mq, mk, seed, off = r[:8]
            aten._scaled_dot_product_cudnn_attention_backward(dout, q, kk, vv, out, lse, seed, off, None, cq, ck,
                                                              mq, mk, 0.0, True, scale=scale)
        return run

    def efficient(kk, vv):
        def run():
            out, lse, seed, off = aten._scaled_dot_product_efficient_attention(q, kk, vv, None, True, 0.0, True, scale=scale)
            aten._scaled_dot_product_efficient_attention_backward(dout, q, kk, vv, None, out, lse, seed, off, 0.0,
                                                                   [True, True, True, False], True, scale=scale)
        return run

    return {"sdpa default (gqa)": sdpa(None), "sdpa flash (gqa)": sdpa(SDPBackend.FLASH_ATTENTION),
            "sdpa cudnn (expanded)": sdpa(SDPBackend.CUDNN_ATTENTION, gqa=False),
            "sdpa efficient (expanded)": sdpa(SDPBackend.EFFICIENT_ATTENTION, gqa=False),
            "aten flash, expanded": flash(ke, ve), "aten flash, gqa-native": flash(k, v),
            "aten cudnn, expanded": cudnn(ke, ve), "aten cudnn, gqa-native": cudnn(k, v),
            "aten efficient, expanded": efficient(ke, ve)}


def markdown(r: dict) -> str:
    seqs = list(r["rows"])
    lines = [f"# Attention kernels for a ring block: {r['device']}, torch {r['torch']}", "",
             "fwd+bwd ms of one causal block, batch 1, 32 query / 8 K/V heads of 128, bf16 (mean of 10 back-to-back "
             "calls). `sdpa ...`: scaled_dot_product_attention under one backend; `aten ...`: the ops the ring calls, "
             "which return the log-sum-exp it merges with.", "",
             "| kernel | " + " | ".join(f"{s} tokens" for s in seqs) + " |", "|---|" + "---:|" * len(seqs)]
    for name in r["rows"][seqs[0]]:
        cells = [r["rows"][s][name] for s in seqs]
        lines.append(f"| {name} | " + " | ".join(f"{c:.3f}" if isinstance(c, float) else str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_arg(ap)
    add_smoke_arg(ap)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("cp_kernel_probe: CUDA only (the SDPA backends it compares are GPU kernels)", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "rows": {}}
    for seq in (256,) if a.smoke else (4096, 16384):
        q = torch.randn(1, 32, seq, 128, device=dev, dtype=torch.bfloat16)
        k, v = (torch.randn(1, 8, seq, 128, device=dev, dtype=torch.bfloat16) for _ in range(2))
        dout = torch.randn_like(q)
        row = {}
        for name, fn in variants(q, k, v, dout).items():
            try:
                row[name] = round(mean_call_ms(fn, dev, reps=2 if a.smoke else 10, warmup=2), 3)
            except Exception as e:  # noqa: BLE001 - a probe: record what each backend says
                row[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            print(seq, name, row[name], flush=True)
        out["rows"][seq] = row
    write_results(out, os.path.join(out_dir(a), "cp_kernel_probe_h200"), markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
