"""The experts' GEMMs of one chunk, grouped (torch._grouped_mm) against the per-expert loop, forward
and backward apart, at the EP benchmark's shapes with even and skewed rows per expert; and where the
device time of the grouped backward goes (kernels by time). Ratios on CPU, absolute times on a GPU.

    python benchmarks/probes/ep_grouped_probe.py --device cuda
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _lib
from _lib.common import add_out_arg, add_smoke_arg, device_label, mean_call_ms, out_dir, write_results
from _lib.unexported import GROUPED_DEVICES, Groups, experts_backward, experts_forward

ROWS = {"uniform": [2048] * 8, "skewed": [8192] + [1170] * 6 + [1172]}  # 16384 rows: 8192 tokens x top-2
SMOKE_ROWS = {"uniform": [32] * 8, "skewed": [128] + [18] * 6 + [20]}
"""--smoke: 256 rows, the same two shapes of load."""


@contextlib.contextmanager
def per_expert_loop():
    """experts_forward / experts_backward on the per-expert loop: no device takes the grouped path inside."""
    saved = set(GROUPED_DEVICES)
    GROUPED_DEVICES.clear()
    try:
        yield
    finally:
        GROUPED_DEVICES.update(saved)


def grouped_ran(fn) -> bool:
    """Whether fn() called torch._grouped_mm: read from the profiler's ops, not assumed."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return any(e.key == "aten::_grouped_mm" for e in prof.key_averages())


def run(device: str, dtype: torch.dtype, hidden: int, ffn: int, reps: int, rows: dict = ROWS) -> dict:
    dev = torch.device(device)
    g = torch.Generator().manual_seed(0)
    out = {"device": device_label(device), "dtype": str(dtype).split(".")[-1], "hidden": hidden, "ffn": ffn,
           "torch": torch.__version__, "rows": {}}
    for name, sizes in rows.items():
        e, m = len(sizes), sum(sizes)
        r = lambda *s: (torch.randn(*s, generator=g) * 0.05).to(dev, dtype)  # noqa: E731
        x, w1, b1, w2, b2, dy = r(m, hidden), r(e, ffn, hidden), r(e, ffn), r(e, hidden, ffn), r(e, hidden), r(m, hidden)
        groups = Groups(torch.tensor(sizes, device=dev), m, sizes)  # as a dispatch plan hands them over
        grads = [torch.zeros(t.shape, device=dev, dtype=dtype) for t in (w1, b1, w2, b2)]
        _, pre = experts_forward(x, groups, w1, b1, w2, b2, True)
        fwd = lambda: experts_forward(x, groups, w1, b1, w2, b2, True)  # noqa: E731
        bwd = lambda: experts_backward(dy, x, pre, groups, w1, w2, grads)  # noqa: E731
        row = {"grouped_ran": grouped_ran(fwd)}
        with per_expert_loop():
            if grouped_ran(fwd):  # the loop rows would time the grouped path again: say so, never a number
                raise RuntimeError("the per-expert loop could not be forced: GROUPED_DEVICES no longer decides "
                                   "which path experts_forward takes")
        row["fwd grouped"] = mean_call_ms(fwd, dev, reps)
        with per_expert_loop():
            row["fwd loop"] = mean_call_ms(fwd, dev, reps)
        row["bwd grouped"] = mean_call_ms(bwd, dev, reps)
        with per_expert_loop():
            row["bwd loop"] = mean_call_ms(bwd, dev, reps)
        if dev.type == "cuda":
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    bwd()
                torch.cuda.synchronize()
            events = [(ev.key, ev.device_time_total / 5e3) for ev in prof.key_averages() if ev.device_time_total > 0]
            row["bwd grouped kernels"] = sorted(events, key=lambda t: -t[1])[:8]
        out["rows"][name] = row
    return out


def markdown(r: dict) -> str:
    lines = [f"# Expert GEMMs of one chunk, grouped vs loop: {r['device']}, {r['dtype']}, torch {r['torch']}", "",
             f"8 local experts, hidden {r['hidden']}, expert ffn {r['ffn']}, 16384 rows (uniform: 2048 each; skewed: "
             "8192 on one expert, ~1170 on each other; a --smoke run: 256). Mean ms per call of back-to-back calls.", "",
             "| rows | fwd grouped | fwd loop | grouped/loop | bwd grouped | bwd loop | grouped/loop |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, row in r["rows"].items():
        lines.append(f"| {name} | {row['fwd grouped']:.3f} | {row['fwd loop']:.3f} | {row['fwd grouped'] / row['fwd loop']:.2f} "
                     f"| {row['bwd grouped']:.3f} | {row['bwd loop']:.3f} | {row['bwd grouped'] / row['bwd loop']:.2f} |")
    for name, row in r["rows"].items():
        if "bwd grouped kernels" in row:
            lines += ["", f"Grouped backward, {name}: device ms per call by kernel", "", "| kernel | ms |", "|---|---:|"]
            lines += [f"| `{k[:90]}` | {t:.3f} |" for k, t in row["bwd grouped kernels"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--hidden", type=int, default=None, help="default: 2048 on CUDA, 256 on CPU")
    ap.add_argument("--ffn", type=int, default=None, help="default: 1408 on CUDA, 512 on CPU")
    ap.add_argument("--reps", type=int, default=20)
    add_out_arg(ap)
    add_smoke_arg(ap)
    a = ap.parse_args(argv)
    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is visible", file=sys.stderr)
        return 2
    if a.smoke:  # 256 rows of width 16, two calls each
        a.hidden, a.ffn, a.reps = a.hidden or 16, a.ffn or 32, 2
    r = run(a.device, torch.bfloat16 if cuda else torch.float32, a.hidden or (2048 if cuda else 256),
            a.ffn or (1408 if cuda else 512), a.reps, SMOKE_ROWS if a.smoke else ROWS)
    write_results(r, os.path.join(out_dir(a), f"ep_grouped_probe_{'cuda' if cuda else 'cpu'}"), markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
