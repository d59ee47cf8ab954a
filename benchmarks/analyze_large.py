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

`--one-rank-mb MB` is the test of record for one large file: one rank's trace of MB megabytes shaped like
what `torch.profiler` writes (`_lib/kineto_trace.py`: Python frame stacks, CPU ops, launches and flows, GEMMs
on two streams, NCCL all-gathers and reduce-scatters on two more, ProfilerStep#N), analyzed by
`overlapkit analyze --json --progress` in a child process: wall time, the child's max RSS, and when its
first progress line came; with `--hta-path` (a `pip install --target` of HolisticTraceAnalysis), HTA's
`get_comm_comp_overlap` on the same file beside it (capped at --hta-timeout s and --hta-max-gb GB).

    python benchmarks/analyze_large.py --one-rank-mb 200 --hta-path /tmp/hta   # analyze_large_one_rank_<host>.md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
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
         "'MAXRSS_KB %d %.3f\\n' % (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "
         "resource.getrusage(resource.RUSAGE_SELF).ru_utime + resource.getrusage(resource.RUSAGE_SELF).ru_stime))); ")


def _measure(code: str, *argv: str) -> tuple[float, float, str]:
    """(seconds, its own max RSS in MB, stdout) of `python -c code argv...` in a child process."""
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", _PEAK + code, *argv], capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if run.returncode != 0:
        raise RuntimeError(f"{code[:60]}... failed: {run.stderr[-2000:]}")
    kb = max(int(line.split()[1]) for line in run.stderr.splitlines() if line.startswith("MAXRSS_KB"))
    return seconds, kb / 1024, run.stdout


def _measure_lines(argv: list[str], env: dict | None = None, timeout_s: float = 3600.0) -> dict:
    """Run `python -c _PEAK... argv` and time it: wall s, max RSS MB, s to the first stderr line, stdout."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", _PEAK + argv[0], *argv[1:]], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    first, err, out_chunks = None, [], []
    reader = threading.Thread(target=lambda: out_chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    for line in proc.stderr:  # the progress lines arrive while the child reads
        if first is None and not line.startswith("MAXRSS_KB"):
            first = time.perf_counter() - t0
        err.append(line)
    code = proc.wait(timeout=timeout_s)
    reader.join()
    seconds = time.perf_counter() - t0
    kb = [x.split()[1:] for x in err if x.startswith("MAXRSS_KB")]
    return dict(code=code, s=seconds, max_rss_mb=int(kb[0][0]) / 1024 if kb else None,
                cpu_s=float(kb[0][1]) if kb else None, first_line_s=first,
                stderr=[x.rstrip() for x in err if not x.startswith("MAXRSS_KB")], stdout="".join(out_chunks))


_HTA = ("import resource; cap = int(float(sys.argv[2]) * 2**30); resource.setrlimit(resource.RLIMIT_AS, (cap, cap)); "
        "sys.path.insert(0, sys.argv[3]); from hta.trace_analysis import TraceAnalysis; "
        "df = TraceAnalysis(trace_dir=sys.argv[1]).get_comm_comp_overlap(); print(df.to_json(orient='records'))")


def one_rank(args) -> None:
    """The test of record for one large file (module docstring)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _lib.kineto_trace import write_trace as write_kineto

    folder = Path(args.dir or tempfile.mkdtemp(prefix="analyze_one_rank_"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "rank0.pt.trace.json"
    t0 = time.perf_counter()
    size = write_kineto(path, args.one_rank_mb)
    made_s = time.perf_counter() - t0
    print(f"wrote {path} ({size / 1e6:.0f} MB) in {made_s:.1f} s", file=sys.stderr)
    analyze = "import runpy; sys.argv[0] = 'overlapkit'; runpy.run_module('overlapkit', run_name='__main__')"
    ours = _measure_lines([analyze, "analyze", str(path), "--json", "--progress"])
    if ours["code"] != 0:
        raise RuntimeError(f"analyze failed: {ours['stderr'][-3:]}")
    doc = json.loads(ours["stdout"])
    rank = doc["ranks"][0]
    result = dict(machine=_machine(), file_mb=size / 1e6, generate_s=made_s, analyze_s=ours["s"],
                  analyze_cpu_s=ours["cpu_s"],
                  analyze_max_rss_mb=ours["max_rss_mb"], first_progress_line_s=ours["first_line_s"],
                  progress_lines=len(ours["stderr"]), steps=len(rank["steps"]), overlap_pct=rank["overlap_pct"],
                  hta=None)
    if args.hta_path:
        hta = _measure_lines([_HTA, str(folder), str(args.hta_max_gb), args.hta_path], timeout_s=args.hta_timeout)
        result["hta"] = dict(code=hta["code"], s=hta["s"], cpu_s=hta["cpu_s"], max_rss_mb=hta["max_rss_mb"],
                             error=None if hta["code"] == 0 else (hta["stderr"] or ["?"])[-1][:300],
                             overlap_pct=json.loads(hta["stdout"])[0].get("comp_comm_overlap_pctg")
                             if hta["code"] == 0 else None)
    from _lib.common import out_dir, write_results

    write_results(result, os.path.join(out_dir(args), f"analyze_large_one_rank_{result['machine']['host']}"),
                  _one_rank_markdown)
    if not args.dir:
        shutil.rmtree(folder, ignore_errors=True)


def _machine() -> dict:
    import platform

    return dict(host=platform.node().split(".")[0] or "host", cpus=os.cpu_count(), python=platform.python_version(),
                date=time.strftime("%Y-%m-%d"), load_1min=os.getloadavg()[0])


def _one_rank_markdown(r: dict) -> str:
    m, h = r["machine"], r["hta"]
    hta = ("not run (no --hta-path)" if h is None else
           f"{h['s']:.1f} | {h['cpu_s']:.1f} | {h['max_rss_mb']:.0f} | | | {h['overlap_pct']:.1f}" if h["code"] == 0 else
           f"failed after {h['s']:.1f} s (max RSS {h['max_rss_mb'] or 0:.0f} MB): {h['error']}")
    return "\n".join([
        f"One rank's {r['file_mb']:.0f} MB profiler-shaped trace (`benchmarks/analyze_large.py --one-rank-mb`), "
        f"{m['host']}, {m['cpus']} CPUs, Python {m['python']}, {m['date']}, load {m['load_1min']:.1f} at the end:", "",
        "| | wall s | CPU s | max RSS MB | first progress line s | steps | overlap % |",
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| overlapkit analyze --json --progress | {r['analyze_s']:.1f} | {r['analyze_cpu_s']:.1f} | "
        f"{r['analyze_max_rss_mb']:.0f} | "
        f"{r['first_progress_line_s']:.2f} | {r['steps']} | {r['overlap_pct']:.1f} |",
        f"| HolisticTraceAnalysis 0.5.0 get_comm_comp_overlap | {hta} |", ""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one-rank-mb", type=float, help="one rank's profiler-shaped trace of this many MB instead")
    ap.add_argument("--hta-path", help="with --one-rank-mb: HolisticTraceAnalysis installed here (pip --target)")
    ap.add_argument("--hta-timeout", type=float, default=600.0, help="seconds HTA may take")
    ap.add_argument("--hta-max-gb", type=float, default=10.0, help="address space HTA may take, GB")
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--mb", type=float, default=32.0, help="MB of JSON per rank")
    ap.add_argument("--slow-rank", type=int, default=3)
    ap.add_argument("--dir", help="where to write the traces (default: a temporary directory, removed after)")
    ap.add_argument("--out", default=None, help="results folder (default: benchmarks/results; with --smoke a new "
                                                "temporary folder)")
    ap.add_argument("--smoke", action="store_true", help="2 ranks of 0.5 MB: shows the script runs, measures nothing")
    args = ap.parse_args()
    if args.one_rank_mb:
        if args.smoke:
            args.one_rank_mb = 1.0
        return one_rank(args)
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
