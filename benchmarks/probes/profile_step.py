"""Profile overlapkit steps with torch.profiler and the timeline recorder at once, and check
that the trace analyzer and the recorder see the same overlap.

Four variants, each profiled on its own: a pipelined TP step (`all_gather_matmul`, every
chunk's GEMM under the next chunk's transfer) and its sequential reference (all-gather, then
one GEMM), a data-parallel step (`DataParallel`, bucket all-reduces during backward) and its
sequential reference (`overlap=False`). For each, every rank's profiler trace is read back
with `overlapkit.timeline.read_traces`, the recorder's spans of the same steps are matched to
the traced ones (`compare_spans`), and both sources go through the one report.

    python benchmarks/probes/profile_step.py                    # CPU, gloo, 2 ranks
    python3 benchmarks/probes/profile_step.py --device cuda     # NCCL, one rank per visible GPU

Writes benchmarks/results/profile_step_<device>.json and .md, and the timeline pictures of the
overlapped variants (trace and recorder) as .png; `--trace-dir` keeps the profiler traces.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, schedule

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _lib
from _lib.common import add_common_args, device_label, out_dir, run_ranks, world_size, write_results
from _lib.presets import SMOKE_GPT
from _lib.unexported import all_gather_matmul, comm, compare_spans
from overlapkit.data_parallel import DataParallel
from overlapkit.models import GPT, GPTConfig, lm_loss
from overlapkit.timeline import compute_span, plot_spans, read_traces, record, report_spans, report_traces
from overlapkit.timeline import print_report, write_chrome_trace

PRESETS = {
    "cpu": dict(tp_rows=256, tp_in=512, tp_out=1024, dtype="float32",
                gpt=dict(vocab_size=2048, seq_len=64, hidden=256, num_heads=4, ffn_hidden=1024, num_layers=4),
                batch=2, bucket_mb=2.0),
    "cuda": dict(tp_rows=2048, tp_in=8192, tp_out=7168, dtype="bfloat16",
                 gpt=dict(vocab_size=32768, seq_len=512, hidden=1024, num_heads=16, ffn_hidden=4096, num_layers=8),
                 batch=8, bucket_mb=25.0),
}
SMOKE = dict(tp_rows=16, tp_in=32, tp_out=64, dtype="float32", gpt=SMOKE_GPT, batch=1, bucket_mb=0.01)
"""--smoke: the same four variants at toy sizes."""
VARIANTS = ("tp pipelined", "tp sequential", "dp overlap", "dp sequential")
TOLERANCE_MS = {"cpu": 0.5, "cuda": 0.05}
"""How far a traced span may stick out of its record: clock alignment (CPU: two wall clocks;
CUDA: an offset estimated from the first kernel of each computation)."""
COMM_END_TOLERANCE_MS = {"cpu": 50.0, "cuda": 0.05}
"""gloo closes its profiler range after the future the recorder stamps (see timeline/agree.py)."""


def _step_fn(variant: str, preset: dict, device: torch.device):
    """A closure running one step of `variant` on this rank."""
    group, ws = dist.group.WORLD, dist.get_world_size()
    dtype = getattr(torch, preset["dtype"])
    torch.manual_seed(0)
    if variant.startswith("tp"):
        x = torch.randn(preset["tp_rows"], preset["tp_in"], device=device, dtype=dtype)
        w = torch.randn(preset["tp_out"], preset["tp_in"], device=device, dtype=dtype) / preset["tp_in"] ** 0.5
        gathered = torch.empty(ws * preset["tp_rows"], preset["tp_in"], device=device, dtype=dtype)

        def tp_step():
            if variant == "tp pipelined":
                all_gather_matmul(x, [w], group, name="tp.fc1")
                return
            comm.all_gather(gathered, x, group, kind="tp_all_gather", name="tp.fc1", async_op=False)
            with compute_span("tp.fc1"):
                gathered @ w.t()
        return tp_step
    model = DataParallel(GPT(GPTConfig(**preset["gpt"])).to(device), group, overlap=variant == "dp overlap",
                         bucket_mb=preset["bucket_mb"])
    g = torch.Generator().manual_seed(dist.get_rank())
    idx = torch.randint(0, preset["gpt"]["vocab_size"], (preset["batch"], preset["gpt"]["seq_len"] + 1), generator=g)
    idx = idx.to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def dp_step():
        model.zero_grad()
        with autocast:
            loss = lm_loss(model(idx[:, :-1]), idx[:, 1:])
        loss.backward()
    return dp_step


def _rank_body(device_type: str, preset: dict, steps: int, trace_dir: str, variants: list[str]) -> dict:
    rank = dist.get_rank()
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    out = {}
    for variant in variants:
        step = _step_fn(variant, preset, device)
        step()  # first call: NCCL communicators, allocator, kernels' first launch
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        path = os.path.join(trace_dir, f"{variant.replace(' ', '_')}_rank{rank}.json")
        # One warm-up profiler step (ProfilerStep#0, not in the trace), then `steps` recorded ones.
        with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
                     on_trace_ready=lambda p, path=path: p.export_chrome_trace(path)) as prof:
            with record(device=device) as rec:
                for _ in range(steps + 1):
                    step()
                    prof.step()
                    rec.next_step()
        out[variant] = dict(path=path, spans=rec.spans, origin_unix_ms=rec.origin_unix_ms)
    return out


def analyze(per_rank: list[dict], device_type: str, out_stem: str) -> dict:
    """Both sources through the one report, and how their spans correspond, per variant."""
    rows, agreements = [], []
    for variant in per_rank[0]:
        traces = read_traces([r[variant]["path"] for r in per_rank], last_step=True)
        recorded = []
        for r, t in zip(per_rank, traces):
            spans = [s for s in r[variant]["spans"] if s.step in t.steps]  # the profiled steps only
            recorded += spans
            offset = r[variant]["origin_unix_ms"] - t.origin_unix_ms if device_type == "cpu" else None
            a = compare_spans(spans, t.spans, offset_ms=offset, tol_ms=TOLERANCE_MS[device_type])
            agreements.append(dict(variant=variant, rank=t.rank, matched=a.matched, missing=a.missing[:5],
                                   unmatched=a.unmatched[:5], early_ms=a.early_ms,
                                   late_compute_ms=a.late_compute_ms, late_comm_ms=a.late_comm_ms,
                                   compute_diff_ms=a.compute_diff_ms,
                                   ok=a.ok(TOLERANCE_MS[device_type], COMM_END_TOLERANCE_MS[device_type])))
        for source, report in (("recorder", report_spans(recorded)), ("trace", report_traces(traces))):
            n = len(report.ranks)
            mean = lambda key: sum(getattr(r.total, key) for r in report.ranks) / n  # noqa: E731
            pcts = [r.total.overlap_pct for r in report.ranks if r.total.overlap_pct is not None]
            rows.append(dict(variant=variant, source=source, step_ms=sum(r.step_ms for r in report.ranks) / n,
                             compute_ms=mean("compute_ms"), comm_ms=mean("comm_ms"),
                             exposed_comm_ms=mean("exposed_comm_ms"),
                             overlap_pct=sum(pcts) / len(pcts) if pcts else None,
                             kinds=sorted({k.kind for r in report.ranks for k in r.by_kind})))
        if variant in ("tp pipelined", "dp overlap"):
            tag = variant.replace(" ", "_")
            _plot(lambda p: plot_spans([s for t in traces for s in t.spans], p, title=f"{variant}: profiler trace"),
                  f"{out_stem}_{tag}_trace.png")
            _plot(lambda p: plot_spans(recorded, p, title=f"{variant}: recorder"), f"{out_stem}_{tag}_recorder.png")
            write_chrome_trace(recorded, f"{out_stem}_{tag}_recorder_perfetto.json")
            print(f"\n== {variant}: report of the profiler traces ==")
            print_report(report_traces(traces), detail=False)
    return dict(rows=rows, agreement=agreements)


def _plot(draw, path: str) -> None:
    try:
        draw(path)
    except ImportError as e:  # matplotlib missing on the machine: the numbers still stand
        print(f"no picture {path}: {e}", file=sys.stderr)


def markdown(result: dict) -> str:
    fmt = lambda v, spec: "—" if v is None else format(v, spec)  # noqa: E731
    lines = [f"Recorder and profiler trace of the same steps, {result['device']}, world size {result['world']}, "
             f"torch {result['torch']}, {result['steps']} profiled steps; ms are per-rank means over the "
             f"profiled window, step ms the mean step.\n",
             "| variant | source | step ms | compute ms | comm ms | exposed comm ms | overlap % | kinds |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['variant']} | {r['source']} | {r['step_ms']:.3f} | {r['compute_ms']:.3f} | "
                     f"{r['comm_ms']:.3f} | {r['exposed_comm_ms']:.3f} | {fmt(r['overlap_pct'], '.1f')} | "
                     f"{', '.join(r['kinds'])} |")
    lines += ["", "| variant | rank | spans matched | missing in trace | unmatched in trace | early ms | "
                  "late compute ms | late comm ms | compute time diff ms | agree |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for a in result["agreement"]:
        lines.append(f"| {a['variant']} | {a['rank']} | {a['matched']} | {len(a['missing'])} | "
                     f"{len(a['unmatched'])} | {a['early_ms']:.3f} | {a['late_compute_ms']:.3f} | "
                     f"{a['late_comm_ms']:.3f} | {a['compute_diff_ms']:.3f} | {'yes' if a['ok'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument("--steps", type=int, default=3, help="profiled steps per variant")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--trace-dir", default=None, help="keep the profiler traces here (default: a temporary folder)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps = 1
    preset = SMOKE if args.smoke else PRESETS[args.device]
    world = world_size(args)
    if world is None:
        return 2
    out = out_dir(args)
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"profile_step_{args.device}")
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = args.trace_dir or tmp
        os.makedirs(trace_dir, exist_ok=True)
        per_rank = run_ranks(_rank_body, world, args.device, preset, args.steps, trace_dir, args.variants,
                             device=args.device, timeout_s=600.0)
        result = analyze(per_rank, args.device, stem)
    result.update(device=device_label(args.device),
                  world=world, torch=torch.__version__, steps=args.steps, preset=preset)
    write_results(result, stem, markdown)
    for a in result["agreement"]:
        if not a["ok"]:
            print(f"disagreement: {a['variant']} rank {a['rank']}: missing in trace {a['missing']}, "
                  f"unmatched in trace {a['unmatched']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
