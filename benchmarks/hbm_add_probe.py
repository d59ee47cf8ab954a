"""Whether `x + x` moves two or three tensors' worth of DRAM traffic: x + x beside x + y on one GPU.

The cost model's memory-bound bandwidth is calibrated on `x + x` (costmodel.calibration). If the
two timings match at 3 tensors for x + y and 2 for x + x, the second read of x hits in cache and
the calibration must count two accesses. Prints GB/s under both counts and writes JSON.

    python benchmarks/hbm_add_probe.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from _common import mean_call_ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    rows, cuda = [], torch.device("cuda")
    for h in (4096, 8192, 16384):
        x = torch.randn(8192, h, device=cuda, dtype=torch.bfloat16)
        y = torch.randn_like(x)
        nbytes = x.numel() * x.element_size()
        xx, xy = mean_call_ms(lambda: x + x, cuda, 50, warmup=5), mean_call_ms(lambda: x + y, cuda, 50, warmup=5)
        rows.append(dict(hidden=h, x_plus_x_ms=xx, x_plus_y_ms=xy,
                         x_plus_x_gbps_2acc=2 * nbytes / xx / 1e6, x_plus_x_gbps_3acc=3 * nbytes / xx / 1e6,
                         x_plus_y_gbps_3acc=3 * nbytes / xy / 1e6))
        print(rows[-1])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "hbm_add_probe_h200.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
