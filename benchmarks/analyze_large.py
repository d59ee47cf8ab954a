"""`overlapkit analyze` on a large job: N ranks of generated Kineto traces (default 16 x 32 MB = 512 MB of
JSON), streamed, in bounded memory: wall time and peak memory (max RSS of the analyzing process), against
parsing one rank's file whole with json.loads.

The traces are made here (`write_trace`): per step, on each rank, a ProfilerStep range, nested CPU ops
(forward/backward/optimizer, the shapes PyTorch writes), flow events, a launch and a kernel per op (GEMMs on
the compute stream, bucketed NCCL all-reduces on the NCCL stream with record_param_comms metadata), rank
`--slow-rank` running its kernels 20 % longer (SLOW). What is kept by the reader is what a real trace of that
size gives it; what it drops (args, flows, python functions) is what makes real traces large.

    python benchmarks/analyze_large.py                          # 16 ranks x 32 MB, in /tmp
    python benchmarks/analyze_large.py --smoke                  # 2 ranks x 0.5 MB, results in a temporary folder

Writes benchmarks/results/analyze_large.json and .md (or under --out).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BASE_NS = 1_750_000_000_000_000_000
SLOW = 1.2
"""The slow rank's kernels take this much longer."""
EVENT_BYTES = 330
"""About how many bytes of JSON one generated event takes (to size a trace in MB)."""


def _events(rank: int, world: int, steps: int, ops_per_step: int, slow_rank: int | None):
    """The events of one rank (µs). The GPU is the bottleneck (kernels outlast their launches); each
    bucket's all-reduce ends on every rank when the slowest rank has started it, and the compute
    stream waits for it, so the ranks line up again after every bucket, as a real job does."""
    corr, t, pid = 1000, 0.0, 100 + rank
    mine_f = SLOW if rank == slow_rank else 1.0
    slowest_f = SLOW if slow_rank is not None else 1.0
    for step in range(steps):
        step_start = t
        phases = (("## forward ##", ops_per_step // 3), ("## backward ##", ops_per_step // 2),
                  ("Optimizer.step#SGD.step", ops_per_step - ops_per_step // 3 - ops_per_step // 2))
        mine = slowest = t + 20.0
        for phase, n in phases:
            yield {"ph": "X", "cat": "user_annotation", "name": phase, "pid": pid, "tid": 1, "ts": t,
                   "dur": n * 12.0, "args": {}}
            for k in range(n):
                corr += 1
                op = "aten::mm" if k % 4 else "aten::add_"
                yield {"ph": "X", "cat": "cpu_op", "name": op, "pid": pid, "tid": 1, "ts": t, "dur": 10.0,
                       "args": {"External id": corr, "Record function id": 0, "Sequence number": corr,
                                "Input Dims": [[512, 512], [512, 512]], "Input type": ["float", "float"],
                                "Input Strides": [[512, 1], [512, 1]], "Concrete Inputs": ["", ""]}}
                yield {"ph": "X", "cat": "python_function", "name": f"model.py({100 + k % 50}): forward",
                       "pid": pid, "tid": 1, "ts": t + 0.5, "dur": 9.0, "args": {"Python id": corr}}
                yield {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": pid, "tid": 1,
                       "ts": t + 2.0, "dur": 4.0, "args": {"External id": corr, "cbid": 211, "correlation": corr}}
                yield {"ph": "s", "id": corr, "pid": pid, "tid": 1, "ts": t + 2.0, "cat": "ac2g", "name": "ac2g"}
                base = 20.0 if op == "aten::mm" else 5.0
                start = max(mine, t + 6.0)
                mine = start + base * mine_f
                slowest = max(slowest, t + 6.0) + base * slowest_f
                yield {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32"
                       if op == "aten::mm" else "void at::native::vectorized_elementwise_kernel<4>",
                       "pid": 0, "tid": 7, "ts": start, "dur": base * mine_f,
                       "args": {"External id": corr, "queued": 0, "device": 0, "context": 1, "stream": 7,
                                "correlation": corr, "registers per thread": 128, "shared memory": 49152,
                                "blocks per SM": 1.2, "warps per SM": 4.8, "grid": [64, 4, 1], "block": [128, 1, 1],
                                "est. achieved occupancy %": 12}}
                yield {"ph": "f", "id": corr, "pid": 0, "tid": 7, "ts": start, "cat": "ac2g", "name": "ac2g", "bp": "e"}
                if phase == "## backward ##" and k % 64 == 63:  # a gradient bucket's all-reduce
                    corr += 1
                    meta = {"Collective name": "allreduce", "In msg nelems": 1 << 22, "Out msg nelems": 1 << 22,
                            "dtype": "Float", "Group size": world, "Process Group Ranks": str(list(range(world))),
                            "Process Group Name": "0"}
                    yield {"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": pid, "tid": 1,
                           "ts": t + 10.5, "dur": 1.0, "args": {"External id": corr, **meta}}
                    yield {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": pid, "tid": 1,
                           "ts": t + 10.6, "dur": 0.5, "args": {"correlation": corr}}
                    end = max(slowest, mine) + 60.0
                    yield {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
                           "pid": 0, "tid": 20, "ts": mine, "dur": end - mine,
                           "args": {"External id": corr, "device": 0, "stream": 20, "correlation": corr, **meta}}
                    mine = slowest = end  # the compute stream waits for the bucket (an event)
                t += 12.0
        t = max(t, mine, slowest) + 50.0
        yield {"ph": "M", "name": "_step_end", "step": step, "start": step_start, "end": t}


def write_trace(path: Path, rank: int, world: int, mb: float, slow_rank: int | None = None,
                steps: int = 4) -> int:
    """Write one rank's trace of about `mb` MB; returns its size in bytes."""
    ops_per_step = max(30, int(mb * 1e6 / EVENT_BYTES / steps / 3.9))
    with open(path, "w") as f:
        f.write('{"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H200"}], '
                f'"distributedInfo": {{"backend": "nccl", "rank": {rank}, "world_size": {world}}}, '
                '"traceEvents": [\n')
        first = True
        for e in _events(rank, world, steps, ops_per_step, slow_rank):
            if e.get("name") == "_step_end":  # the step's CPU range, now that its end is known
                e = {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{e['step']}", "pid": 100 + rank,
                     "tid": 1, "ts": e["start"], "dur": e["end"] - e["start"], "args": {}}
            f.write(("" if first else ",\n") + json.dumps(e))
            first = False
        f.write(f'\n], "baseTimeNanoseconds": {BASE_NS}, "displayTimeUnit": "ms"}}\n')
    return path.stat().st_size


_PEAK = ("import atexit, resource, sys; atexit.register(lambda: sys.stderr.write("
         "'MAXRSS_KB %d\\n' % resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)); ")


def _measure(code: str, *argv: str) -> tuple[float, float, str]:
    """(seconds, its own max RSS in MB, stdout) of `python -c code argv...` in a child process."""
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", _PEAK + code, *argv], capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if run.returncode != 0:
        raise RuntimeError(f"{code[:60]}... failed: {run.stderr[-2000:]}")
    kb = max(int(line.split()[1]) for line in run.stderr.splitlines() if line.startswith("MAXRSS_KB"))
    return seconds, kb / 1024, run.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--mb", type=float, default=32.0, help="MB of JSON per rank")
    ap.add_argument("--slow-rank", type=int, default=3)
    ap.add_argument("--dir", help="where to write the traces (default: a temporary directory, removed after)")
    ap.add_argument("--out", default=None, help="results folder (default: benchmarks/results; with --smoke a new "
                                                "temporary folder)")
    ap.add_argument("--smoke", action="store_true", help="2 ranks of 0.5 MB: shows the script runs, measures nothing")
    args = ap.parse_args()
    if args.smoke:
        args.ranks, args.mb, args.slow_rank = 2, 0.5, 1
    folder = Path(args.dir or tempfile.mkdtemp(prefix="analyze_large_"))
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    sizes = [write_trace(folder / f"rank{r}.pt.trace.json", r, args.ranks, args.mb, args.slow_rank)
             for r in range(args.ranks)]
    made_s = time.perf_counter() - t0
    total_mb = sum(sizes) / 1e6
    print(f"wrote {args.ranks} traces, {total_mb:.0f} MB, in {made_s:.1f} s", file=sys.stderr)
    analyze = "import runpy; sys.argv[0] = 'overlapkit'; runpy.run_module('overlapkit', run_name='__main__')"
    streamed_s, streamed_mb, out = _measure(analyze, "analyze", str(folder), "--json", "--progress")
    doc = json.loads(out)
    whole_s, whole_mb, _ = _measure("import json; print(len(json.load(open(sys.argv[1]))['traceEvents']))",
                                    str(folder / "rank0.pt.trace.json"))
    _, baseline_mb, _ = _measure("from overlapkit.timeline import analyze, plot_spans")
    paths = doc["critical_paths"]
    waited = {}
    for s in doc["critical_path"]:
        if s["why"].startswith("waiting for rank"):
            waited[s["rank"]] = waited.get(s["rank"], 0.0) + s["ms"]
    result = dict(ranks=args.ranks, mb_per_rank=args.mb, total_json_mb=total_mb, generate_s=made_s,
                  analyze_s=streamed_s, analyze_max_rss_mb=streamed_mb, python_baseline_rss_mb=baseline_mb,
                  json_loads_one_rank_s=whole_s, json_loads_one_rank_rss_mb=whole_mb,
                  steps=len(paths), path_ms=[p["path_ms"] for p in paths], window_ms=[p["window_ms"] for p in paths],
                  most_waited_for_rank=max(waited, key=waited.get) if waited else None, slow_rank=args.slow_rank)
    # imported only now: its torch import would otherwise count in every child's peak (Linux keeps a
    # process's max RSS across the fork and exec that start it)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _lib.common import out_dir, write_results

    write_results(result, os.path.join(out_dir(args), "analyze_large"), _markdown)
    if not args.dir:
        shutil.rmtree(folder, ignore_errors=True)


def _markdown(r: dict) -> str:
    return "\n".join([
        "| ranks | JSON MB | analyze s | analyze max RSS MB | python+overlapkit import RSS MB | json.loads of ONE rank: s, RSS MB | path names rank (slow rank) |",
        "|---:|---:|---:|---:|---:|---:|---|",
        f"| {r['ranks']} | {r['total_json_mb']:.0f} | {r['analyze_s']:.1f} | {r['analyze_max_rss_mb']:.0f} | "
        f"{r['python_baseline_rss_mb']:.0f} | {r['json_loads_one_rank_s']:.1f}, {r['json_loads_one_rank_rss_mb']:.0f} | "
        f"{r['most_waited_for_rank']} ({r['slow_rank']}) |", ""])


if __name__ == "__main__":
    main()
