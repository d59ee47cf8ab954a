"""The LM head and its fp32 cross-entropy, measured beside the cost model's price for them.

What the last pipeline stage computes after its layers — the vocabulary GEMM, the logits cast to
fp32, the cross-entropy and its backward — is outside every overlapped layer, so the model prices
it from bytes per logit (`overlapkit.costmodel.layer.CE_BYTES`). This times it with CUDA events
(or the wall clock on CPU) at Llama-3-like shapes, one GPU, and prints measured vs predicted.

    python benchmarks/probes/lm_head_probe.py --device cuda --out benchmarks/results   # on the H200
    python benchmarks/probes/lm_head_probe.py --smoke                                  # a CPU smoke run
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _lib
from _lib.common import add_common_args, device_label, mean_call_ms, out_dir, write_results  # noqa: E402

SHAPES = ((8192, 4096, 128256), (8192, 8192, 128256 // 8), (4096, 2048, 131072), (2048, 12288, 51200 // 8))
"""(tokens, hidden, vocab on this rank): Llama 3 8B; 70B at TP 8; Megatron's 1.7B; GPT-3 at TP 8."""
QUICK = ((256, 128, 1024), (128, 64, 4096))


def measure(tokens: int, hidden: int, vocab: int, device: torch.device, reps: int) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    w = (torch.randn(vocab, hidden, device=device, dtype=dtype) / hidden**0.5).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), device=device)

    def head():
        return x @ w.t()

    def head_loss():
        return F.cross_entropy(head().float(), target)

    def head_loss_backward():
        x.grad = w.grad = None
        head_loss().backward()

    gemm = mean_call_ms(head, device, reps)
    fwd = mean_call_ms(head_loss, device, reps)
    fwd_bwd = mean_call_ms(head_loss_backward, device, reps)
    return {"tokens": tokens, "hidden": hidden, "vocab": vocab, "gemm_ms": gemm, "fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd}


def predicted(row: dict, hardware: str = "h200-sxm") -> dict:
    """The cost model's LM head + cross-entropy for the same shape (TP 1: vocab is this rank's)."""
    from overlapkit.costmodel import ModelConfig, ParallelConfig, predict, preset

    model = ModelConfig(hidden=row["hidden"], ffn_hidden=row["hidden"], num_layers=1, num_heads=1,
                        seq_len=row["tokens"], vocab_size=row["vocab"], gated_mlp=False)
    r = predict(model, ParallelConfig(sp=False), preset(hardware))
    gemm = next(x["time_ms"] for x in r.head_fwd.rows if x["op"] == "lm_head fwd")
    return {"gemm_ms": gemm, "fwd_ms": r.head_fwd.wall_ms, "fwd_bwd_ms": r.head_fwd.wall_ms + r.head_bwd.wall_ms}


def markdown(result: dict) -> str:
    lines = [f"LM head + fp32 cross-entropy, {result['device']}, mean of {result['reps']} calls; "
             f"predicted by the cost model ({result['hardware']} preset) where the device is a GPU.", "",
             "| tokens | hidden | vocab | what | measured ms | predicted ms | error % |", "|---:|---:|---:|---|---:|---:|---:|"]
    for r in result["rows"]:
        for k in ("gemm_ms", "fwd_ms", "fwd_bwd_ms"):
            p = r.get("predicted", {}).get(k)
            err = f"{100 * (p - r[k]) / r[k]:+.1f}" if p else "—"
            shown = f"{p:.3f}" if p else "—"
            lines.append(f"| {r['tokens']} | {r['hidden']} | {r['vocab']} | {k[:-3]} | {r[k]:.3f} | {shown} | {err} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    ap.add_argument("--hardware", default="h200-sxm", help="cost-model preset to predict with")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="the CPU's small shapes on any device")
    args = ap.parse_args(argv)
    if args.smoke:
        args.quick, args.reps = True, 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is visible", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    rows = []
    for shape in (QUICK if args.quick or device.type == "cpu" else SHAPES):
        row = measure(*shape, device, args.reps)
        if device.type == "cuda":
            row["predicted"] = predicted(row, args.hardware)
        rows.append(row)
    result = {"device": device_label(args.device), "hardware": args.hardware, "reps": args.reps, "rows": rows}
    write_results(result, os.path.join(out_dir(args), f"lm_head_probe_{args.device}"), markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
