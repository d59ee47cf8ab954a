"""Where a data-parallel step spends host time: overlapkit DataParallel with overlap on and off,
and PyTorch DDP, each profiled (CPU side) for a few steps on one rank.

On a GPU a small model's step is bound by how fast the host issues kernels, so the host cost
of gradient hooks and collective launches shows up as step time. This prints, per variant, the
operators with the most self CPU time, and writes them to
benchmarks/results/dp_overhead_probe_<device>.md.

    python3 benchmarks/probes/dp_overhead_probe.py --device cuda
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _lib
from _lib.common import add_common_args, device_label, out_dir, run_ranks, world_size
from _lib.presets import DP_PRESETS, SMOKE_DP
from overlapkit.data_parallel import DataParallel
from overlapkit.models import GPT, GPTConfig, lm_loss


def _body(device_type: str, steps: int, preset: dict) -> dict:
    rank = dist.get_rank()
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    cfg = GPTConfig(**preset["gpt"])
    group = dist.group.WORLD
    variants = {
        "overlapkit overlap=True": lambda m: DataParallel(m, group, overlap=True, bucket_mb=preset["bucket_mb"]),
        "overlapkit overlap=False": lambda m: DataParallel(m, group, overlap=False, bucket_mb=preset["bucket_mb"]),
        "torch DDP": lambda m: DistributedDataParallel(m, process_group=group, bucket_cap_mb=preset["bucket_mb"],
                                                       device_ids=[device.index] if device.type == "cuda" else None),
    }
    idx = torch.randint(0, cfg.vocab_size, (preset["batch"], cfg.seq_len + 1)).to(device)
    x, y = idx[:, :-1], idx[:, 1:]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    tables = {}
    for name, wrap in variants.items():
        torch.manual_seed(0)
        model = wrap(GPT(cfg).to(device))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model=model, opt=opt):
            opt.zero_grad()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = lm_loss(model(x), y)
            loss.backward()
            opt.step()

        for _ in range(3):
            step()
        with profile(activities=activities) as prof:
            for _ in range(steps):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        tables[name] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60)
    return tables


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    if args.smoke:  # the tiny GPT, one profiled step
        args.steps = 1
    world = world_size(args)
    if world is None:
        return 2
    preset = SMOKE_DP if args.smoke else DP_PRESETS[args.device]
    tables = run_ranks(_body, 1, args.device, args.steps, preset, device=args.device, timeout_s=600.0)[0]
    text = f"Host time of a DP step, {device_label(args.device)}, torch {torch.__version__}, one rank, " \
           f"{args.steps} profiled steps per variant (self CPU time, top 15 operators).\n\n"
    text += "\n".join(f"## {name}\n\n```\n{table}\n```\n" for name, table in tables.items())
    out = out_dir(args)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"dp_overhead_probe_{args.device}.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
