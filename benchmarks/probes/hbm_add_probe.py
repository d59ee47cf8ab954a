"""Whether `x + x` moves two or three tensors' worth of DRAM traffic: x + x beside x + y on one GPU.

The cost model's memory-bound bandwidth is calibrated on `x + x` (costmodel.calibration). If the
two timings match at 3 tensors for x + y and 2 for x + x, the second read of x hits in cache and
the calibration must count two accesses. Prints GB/s under both counts and writes JSON.

    python benchmarks/probes/hbm_add_probe.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _lib
from _lib.common import add_out_arg, add_smoke_arg, mean_call_ms, out_dir


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_arg(ap)
    add_smoke_arg(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("hbm_add_probe: CUDA only (HBM traffic of one GPU)", file=sys.stderr)
        return 2
    rows, cuda = [], torch.device("cuda")
    tokens, reps = (256, 2) if args.smoke else (8192, 50)
    for h in (256,) if args.smoke else (4096, 8192, 16384):
        x = torch.randn(tokens, h, device=cuda, dtype=torch.bfloat16)
        y = torch.randn_like(x)
        nbytes = x.numel() * x.element_size()
        xx, xy = mean_call_ms(lambda: x + x, cuda, reps, warmup=5), mean_call_ms(lambda: x + y, cuda, reps, warmup=5)
        rows.append(dict(hidden=h, x_plus_x_ms=xx, x_plus_y_ms=xy,
                         x_plus_x_gbps_2acc=2 * nbytes / xx / 1e6, x_plus_x_gbps_3acc=3 * nbytes / xx / 1e6,
                         x_plus_y_gbps_3acc=3 * nbytes / xy / 1e6))
        print(rows[-1])
    out = out_dir(args)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "hbm_add_probe_h200.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
