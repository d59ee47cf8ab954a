"""How often a correct run dies at exit (SIGABRT in gloo's teardown), with and without joining the
work still in flight before the groups are destroyed (`overlapkit.launch.shutdown`).

Each run starts `--world` gloo ranks as forked processes that end with a full interpreter
shutdown (as `spawn`'s and torchrun's processes do; forking only skips re-importing torch, so
a hundred runs fit in minutes), runs one scenario, then tears down either the way
`launch.spawn` and `overlapkit demo` do now (`shutdown(joined=True)`: a barrier per group, in
creation order, then destroy) or the way they did before (`joined=False`: destroy at once).

Scenarios (each ends with work in flight that nobody waited for, as real code does):
  recorded   a recorded all-gather on an overlapkit group, never waited (its completion
             callback is pending when the interpreter shuts down)
  sharded    DataParallel + ShardedOptimizer, 2 steps under the timeline recorder, returning
             right after the last step() (its parameter gathers still in flight)
  demo       one step of `overlapkit demo`'s rank body (tp=2)

Run: python benchmarks/probes/teardown_repeat.py --runs 50        (about 2 s a run here)
Writes benchmarks/results/teardown_repeat_cpu.{json,md} (or under --out); `--json -` prints the JSON only.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _lib

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _lib.common import add_out_arg, add_smoke_arg, device_label, out_dir, write_results  # noqa: E402
from _lib.unexported import DemoConfig, comm, free_port, run_rank, shutdown  # noqa: E402 - imported before forking
from torch.nn import functional as F  # noqa: E402

import overlapkit.data_parallel  # noqa: E402,F401 - imported before forking: each rank starts in a second
from overlapkit.timeline import record  # noqa: E402

SCENARIOS = ("recorded", "sharded", "demo")


def _recorded() -> None:
    group = dist.new_group(list(range(dist.get_world_size())))
    r = dist.get_rank()
    with record():
        out, inp = torch.empty(dist.get_world_size() * 1_000_000), torch.full((1_000_000,), float(r))
        if r == 1:
            time.sleep(0.05)  # the others' gathers are still in flight when they return
        comm.all_gather(out, inp, group, kind="zero_all_gather", name="never waited")


def _sharded() -> None:
    from overlapkit.data_parallel import DataParallel, ShardedOptimizer
    torch.manual_seed(0)
    model = DataParallel(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64)),
                         None, first_bucket_mb=0.01, bucket_mb=0.05)
    opt = ShardedOptimizer(model, torch.optim.AdamW, None, lr=1e-3)
    x = torch.randn(8, 64)
    with record():
        for _ in range(2):
            opt.zero_grad()
            F.mse_loss(model(x), x).backward()
            if dist.get_rank() == 1:
                time.sleep(0.02)
            opt.step()  # the last step's gathers are left in flight


def _demo() -> None:
    run_rank(DemoConfig(tp=dist.get_world_size(), dp=1, steps=1, timeout_s=30))


BODIES = {"recorded": _recorded, "sharded": _sharded, "demo": _demo}


def _rank(rank: int, world: int, port: int, scenario: str, joined: bool) -> int:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import datetime
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    code = 0
    try:
        BODIES[scenario]()
    except Exception:  # noqa: BLE001 - counted as a failed run, not an exit-time death
        code = 3
    shutdown(joined=joined and code == 0)
    return code


def one_run(scenario: str, world: int, joined: bool) -> collections.Counter:
    """How the `world` processes of one run ended: exit0, exit<N>, or the signal's name."""
    port = free_port()
    pids = []
    for r in range(world):
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                code = _rank(r, world, port, scenario, joined)
            finally:
                raise SystemExit(code)  # a full interpreter shutdown in the child, as spawn's children do
        pids.append(pid)
    ends = collections.Counter()
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        ends[signal.Signals(os.WTERMSIG(status)).name if os.WIFSIGNALED(status) else f"exit{os.WEXITSTATUS(status)}"] += 1
    return ends


def _markdown(result: dict) -> str:
    lines = [f"# Process ends after a correct run, {result['world']} gloo ranks a run ({result['device']})", "",
             "| scenario | teardown | runs | processes | ended cleanly | SIGABRT | other | s |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        other = row["processes"] - row["ends"].get("exit0", 0) - row["ends"].get("SIGABRT", 0)
        lines.append(f"| {row['scenario']} | {row['teardown']} | {row['runs']} | {row['processes']} | "
                     f"{row['ends'].get('exit0', 0)} | {row['ends'].get('SIGABRT', 0)} | {other} | {row['s']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--scenario", choices=SCENARIOS, action="append", help="default: all")
    ap.add_argument("--teardown", choices=("joined", "at once"), action="append", help="default: both")
    ap.add_argument("--budget-s", type=float, default=1800.0, help="stop starting runs after this long")
    ap.add_argument("--json", metavar="PATH", help="'-' prints the JSON only; default: <--out>/teardown_repeat_cpu")
    add_out_arg(ap)
    add_smoke_arg(ap)
    args = ap.parse_args(argv)
    if args.smoke:  # one run of each scenario and teardown
        args.runs = 1
    rows, t_start = [], time.monotonic()
    for scenario in args.scenario or SCENARIOS:
        for teardown in args.teardown or ("at once", "joined"):
            ends, runs, t0 = collections.Counter(), 0, time.monotonic()
            while runs < args.runs and time.monotonic() - t_start < args.budget_s:
                ends += one_run(scenario, args.world, teardown == "joined")
                runs += 1
            rows.append(dict(scenario=scenario, teardown=teardown, runs=runs, processes=runs * args.world,
                             ends=dict(ends), s=time.monotonic() - t0))
            print(rows[-1], file=sys.stderr, flush=True)
    result = dict(device=device_label("cpu"), world=args.world, torch=torch.__version__, rows=rows)
    if args.json == "-":
        print(json.dumps(result))
    else:
        write_results(result, args.json or os.path.join(out_dir(args), "teardown_repeat_cpu"), _markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
