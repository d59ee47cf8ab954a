"""What every benchmark script shares: device/world/out/smoke arguments, spawning ranks, lining
them up and timing variants in balanced rounds, the machine's label, and writing a result as JSON +
a markdown table (printed too)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from typing import Any, Callable

import torch

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(BENCHMARKS)
RESULTS = os.path.join(BENCHMARKS, "results")
"""Where results are committed: benchmarks/results."""
DATA = os.path.join(BENCHMARKS, "data")
"""Inputs the benchmarks read that no test needs (test data lives in tests/data)."""
TEST_DATA = os.path.join(ROOT, "tests", "data")
SMOKE_HELP = ("tiny sizes and one or two rounds, on CPU in seconds, results into a new temporary folder unless "
              "--out says where: shows the script runs end to end, measures nothing")


def add_smoke_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)


def add_out_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", default=None, help="results folder (default: benchmarks/results; with --smoke a new "
                                                "temporary folder)")


def out_dir(args: argparse.Namespace) -> str:
    """--out, else benchmarks/results, else (--smoke) a new temporary folder: a smoke run never writes over
    committed results."""
    if args.out:
        return args.out
    if getattr(args, "smoke", False):
        args.out = tempfile.mkdtemp(prefix="overlapkit_smoke_")
        print(f"--smoke: results go to {args.out}", file=sys.stderr)
        return args.out
    return RESULTS


def add_common_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--world", type=int, default=None, help="ranks (default: 2 on CPU, every visible GPU on CUDA)")
    add_out_arg(ap)
    add_smoke_arg(ap)


def run_ranks(fn: Callable, world: int, *args: Any, device: str = "cpu", timeout_s: float = 600.0,
              on_message: Callable[[int, str], None] | None = None) -> list:
    """fn(*args) on `world` fresh ranks (gloo on CPU, NCCL one GPU a rank); their return values, rank by rank."""
    from _lib.unexported import spawn

    return spawn(fn, world, *args, backend=backend(device), timeout_s=timeout_s, on_message=on_message)


def print_message(rank: int, text: str) -> None:
    """on_message for run_ranks: a rank's progress line on stderr."""
    print(f"[rank {rank}] {text}", file=sys.stderr, flush=True)


def init_one_rank(backend_name: str = "gloo") -> None:
    """A process group of this process alone (world size 1), on a free port unless MASTER_PORT is set."""
    from _lib.unexported import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    torch.distributed.init_process_group(backend_name, rank=0, world_size=1)


def world_size(args: argparse.Namespace) -> int | None:
    """Ranks to spawn, or None (after saying why) when --device cuda has no GPU to run on."""
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is visible", file=sys.stderr)
        return None
    return args.world or (torch.cuda.device_count() if args.device == "cuda" else 2)


def backend(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def line_up(device: torch.device) -> None:
    """All ranks line up (and the GPU drains) before a timed call or step starts."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    torch.distributed.all_reduce(torch.zeros(1, device=device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def balanced_orders(n: int) -> list[list[int]]:
    """Rounds of a Williams design over n variants: each runs in every position, and right after
    every other, equally often over the rounds (n rounds for even n, 2n for odd)."""
    first = [0] + [(k + 1) // 2 if k % 2 else n - k // 2 for k in range(1, n)]  # 0, 1, n-1, 2, n-2, ...
    rows = [[(v + r) % n for v in first] for r in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 else rows


def time_variants(step: Callable[[str], None], variants: list[str], steps: int, warmup: int,
                  device: torch.device) -> dict[str, list[float]]:
    """ms per step of each variant, steps after `warmup`, all ranks lined up before each.

    Round i runs the variants in the i-th order of a balanced design, so none always runs first
    or right after the same neighbour (a plain rotation puts each one after the same neighbour
    every round: the ZeRO-3 benchmark read a 4 % gap between two identical configurations so).
    """
    times: dict[str, list[float]] = {k: [] for k in variants}
    orders = balanced_orders(len(variants)) if variants else [[]]
    for i in range(warmup + steps):
        for name in (variants[j] for j in orders[i % len(orders)]):
            line_up(device)
            t0 = time.perf_counter()
            step(name)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= warmup:
                times[name].append((time.perf_counter() - t0) * 1e3)
    return times


def adamw_options(device_type: str) -> dict:
    """AdamW's keyword arguments for a step compared across variants: fused on a GPU (what users run there), foreach
    on CPU. Never torch's default over DTensor parameters there (the single-tensor path): besides paying DTensor
    dispatch per parameter and op, under torch 2.11 each of its ops is keyed in FakeTensor's dispatch cache by the
    step's scalars (the bias corrections), so in one process only the variant that first reaches a step count pays
    the propagation and those behind it hit its entries -- a decided `auto`, ahead by its deciding steps, paid it
    for every twin (probes/fsdp_twin_phases.py --optimizer single shows it)."""
    return dict(fused=True) if device_type == "cuda" else dict(foreach=True)


def lm_train_step(models: dict, opts: dict, vocab_size: int, batch: int, seq_len: int, seed: int,
                  device: torch.device) -> Callable[[str], None]:
    """step(name): one training step of models[name] on a fixed batch of this rank's tokens.

    The batch is drawn once from `seed` (so every variant trains on the same data); the forward
    runs under bf16 autocast on CUDA, in fp32 on CPU; the language-model loss is the GPT's.
    """
    from overlapkit.models import lm_loss

    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab_size, (batch, seq_len + 1), generator=g).to(device)
    x, y = idx[:, :-1], idx[:, 1:]
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else torch.autocast("cpu", enabled=False))

    def step(name: str) -> None:
        opts[name].zero_grad()
        with autocast:
            loss = lm_loss(models[name](x), y)
        loss.backward()
        opts[name].step()
    return step


def mean_call_ms(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 1) -> float:
    """Mean ms per call of `reps` back-to-back calls after `warmup` (CUDA events on a GPU, the
    clock on CPU): throughput of a kernel or op issued repeatedly, not one call's latency."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) * 1e3 / reps


def device_slug(device: str) -> str:
    """The device in a result file's name: cpu, or the GPU's model (h200)."""
    if device == "cpu":
        return "cpu"
    return torch.cuda.get_device_name(0).split()[-1].lower().replace("-", "")


def device_label(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" else f"CPU ({platform.machine()}, gloo)"


def write_results(result: dict, stem: str, markdown: Callable[[dict], str]) -> None:
    """stem.json and stem.md (the table), and the table on stdout. The JSON records the command line that
    produced it (`command`), so a committed table always says how to make it again."""
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    table = markdown(result)  # before `command` joins the result: a table reads only what it measured
    if isinstance(result, dict):
        script = os.path.relpath(os.path.abspath(sys.argv[0]), ROOT) if sys.argv and sys.argv[0] else "?"
        result = {**result, "command": result.get("command") or " ".join(["python", script, *sys.argv[1:]])}
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    with open(stem + ".md", "w") as f:
        f.write(table)
    print(table)


def pipeline_args(description: str) -> argparse.ArgumentParser:
    """The arguments every pipeline benchmark takes: the common ones, threads a rank, steps, warm-up,
    recorded steps, m."""
    ap = argparse.ArgumentParser(description=description)
    add_common_args(ap)
    ap.add_argument("--threads", type=int, default=1, help="torch threads a rank")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--recorded", type=int, default=3)
    ap.add_argument("--microbatches", type=int, default=None, help="m (default 2·pp)")
    return ap


ALL_TO_ALL = ("all_to_all", "alltoall")
EXPERT_EXCHANGES = ALL_TO_ALL + ("gloo:send", "gloo:recv", "nccl:send", "nccl:recv")
"""An expert layer's token exchanges: all-to-alls, and the pairwise sends and receives of `chunks="ranks"`."""
COLLECTIVES = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "wait_tensor")
"""Words naming the ranges of a transfer in a CPU profiler trace (gloo's ranges, c10d's and the functional ops)."""


def comm_share(step, words=ALL_TO_ALL) -> tuple[float, float]:
    """(step ms, communication ms) of one `step()` under torch.profiler: the union of the ranges whose name holds
    one of `words` (any thread). For a peer that waits each collective at once, it is what hiding every one of
    them could save of its step; where transfers run beside compute it is their time in flight."""
    import time

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        step()
        step_ms = 1e3 * (time.perf_counter() - t0)
    from _lib.unexported import intervals as iv

    spans = ((e.time_range.start, e.time_range.end) for e in prof.events() if any(w in e.name.lower() for w in words))
    return step_ms, iv.length(iv.union(spans)) / 1e3  # µs -> ms
