"""`overlapkit plan --calibrate` validated on runs made here: trace one layout, predict others, measure them.

CPU mode (gloo ranks): overlapkit's GPT (or a Hugging Face Llama through `parallelize`) is traced at one
layout (world 4: dp 2 x tp 2; world 2: tp 2); the cost model is calibrated on that trace alone
(plan_tools.read_measured + costmodel.calibrate.fit, what `plan --calibrate` runs) and predicts four other
layouts (`layouts`), each then run and traced the same way in the same invocation, its measured step set
beside the prediction, term by term (compute, exposed communication, the pipeline, host: calibrate.terms).
CUDA mode (one GPU, world size 1): the GPT traced at one micro-batch size predicts the others (no collective
runs at world size 1, so the TP overlap modes are the same program there; the rows say so).

    python benchmarks/probes/calibrate_validation.py --device cpu                  # the 16-core host, overlapkit's GPT
    python benchmarks/probes/calibrate_validation.py --device cpu --model llama    # HF Llama through parallelize (no pp)
    python benchmarks/probes/calibrate_validation.py --device cuda                 # the H200, world size 1
    python benchmarks/probes/calibrate_validation.py --device cpu --smoke          # 2 ranks, tiny sizes, two steps

Each layout runs in its own process session under a wall-clock limit (`--layout-limit`): one that does not
finish (a rank stalled outside any collective's timeout) is killed whole and recorded as failed, and the
results are written after every layout, so a run cut short still leaves the rows it measured.

Writes benchmarks/results/calibrate_validation_<device>_<model>[_smoke].{json,md}. Targets: every predicted
layout within 10 % (16 cores) and 5 % (H200, world size 1) of its measured step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _lib
from _lib.common import SMOKE_HELP, adamw_options, add_out_arg, out_dir, write_results  # noqa: E402

SIZES = {"smoke": dict(hidden=64, num_heads=8, ffn_hidden=256, num_layers=2, seq_len=32, vocab_size=256, batch=4),
         "cpu": dict(hidden=512, num_heads=8, ffn_hidden=2048, num_layers=4, seq_len=256, vocab_size=4096, batch=8),
         "cuda": dict(hidden=2048, num_heads=16, ffn_hidden=8192, num_layers=8, seq_len=2048, vocab_size=32768,
                      batch=4)}
"""GPT sizes and sequences per step of each run kind."""


def layouts(batch: int, arch: str = "gpt", world: int = 4) -> dict:
    """name -> (tp, pp, dp, micro_batch, micro-batches): the traced layout first, then the four predicted ones
    (no pipeline for the HF Llama: overlapkit's stage cutter knows its own GPT only)."""
    if world == 2:
        out = {"tp2 (traced)": (2, 1, 1, batch, 1), "dp2": (1, 1, 2, batch // 2, 1),
               "pp2": (1, 2, 1, batch // 2, 2), "tp2, micro-batch x2": (2, 1, 1, 2 * batch, 1),
               "dp2, micro-batch x2": (1, 1, 2, batch, 1)}
        if arch == "llama":
            del out["pp2"]
            out["tp2, micro-batch /2"] = (2, 1, 1, batch // 2, 1)
        return out
    out = {"dp2 x tp2 (traced)": (2, 1, 2, batch // 2, 1), "tp4": (4, 1, 1, batch, 1),
           "dp4": (1, 1, 4, batch // 4, 1), "pp2 x tp2": (2, 2, 1, batch // 2, 2),
           "dp2 x tp2, micro-batch x2": (2, 1, 2, batch, 1)}
    if arch == "llama":
        del out["pp2 x tp2"]
        out["dp4, micro-batch x2"] = (1, 1, 4, batch // 2, 1)
    return out


def build(arch: str, sizes: dict):
    """The model of one run: overlapkit's GPT, or a Hugging Face Llama of the same widths (SwiGLU, GQA 2:1)."""
    if arch == "gpt":
        from overlapkit.models import GPT, GPTConfig

        return GPT(GPTConfig(**{k: v for k, v in sizes.items() if k != "batch"}))
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        hidden_size=sizes["hidden"], intermediate_size=sizes["ffn_hidden"], num_hidden_layers=sizes["num_layers"],
        num_attention_heads=sizes["num_heads"], num_key_value_heads=sizes["num_heads"] // 2,
        vocab_size=sizes["vocab_size"], max_position_embeddings=sizes["seq_len"], attn_implementation="sdpa"))


def run_rank(sizes: dict, layout: tuple, steps: int, trace_dir: str, overlap: str, device: str,
             arch: str = "gpt") -> dict:
    """One rank of one layout: train `steps` steps under the profiler (one warm-up step first)."""
    import faulthandler

    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from overlapkit import ParallelGroups, optim_param_groups
    from overlapkit.data_parallel import DataParallel
    from overlapkit.models import lm_loss, parallelize

    tp, pp, dp, mb, m = layout
    world = tp * pp * dp
    # A rank still running near its process-group timeout says where every thread is, before it is killed.
    faulthandler.dump_traceback_later(float(os.environ.get("CALIBRATE_STACKS_S", 200)), exit=False)
    if device == "cpu":
        torch.set_num_threads(max(1, cores() // world))
    groups = ParallelGroups.build(tp=tp, dp=dp, pp=pp)
    dev = torch.device("cuda" if device == "cuda" else "cpu")
    torch.manual_seed(0)
    model = build(arch, sizes).to(dev)
    vocab, seq = sizes["vocab_size"], sizes["seq_len"]
    if tp > 1:
        model = parallelize(model, groups, sequence_parallel=True, overlap=overlap)
    if pp > 1:
        from overlapkit.models import gpt_chunks
        from overlapkit.pipeline_parallel import PipelineConfig, PipelineEngine

        chunks, _ = gpt_chunks(model, pp, groups.pp_rank)
        engine = PipelineEngine(chunks, groups.pp, PipelineConfig("1f1b", m), lm_loss)
        params = [p for c in chunks for p in c.parameters()]
    else:
        if dp > 1:
            model = DataParallel(model, groups.dp, sequence_parallel_group=groups.tp if tp > 1 else None)
        chunks, params = [model], list(model.parameters())
    # What a user runs: AdamW (fused on the GPU; foreach on the CPU, fused over DTensors not run under torch 2.11
    # here), clipping by the whole model's norm. The fit reads the optimizer's step off the trace and prices every
    # pass over the parameters at its rate (an SGD or foreach step folded into the fitted rates moved every op's).
    opt = torch.optim.AdamW(optim_param_groups(params), lr=1e-4, **adamw_options(device))
    from overlapkit.expert_parallel import clip_grad_norm_
    gen = torch.Generator().manual_seed(1)
    path = os.path.join(trace_dir, f"rank{groups.rank}.json")
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else []),
                   schedule=schedule(wait=0, warmup=1, active=steps + 1, repeat=1),
                   on_trace_ready=lambda p: p.export_chrome_trace(path))
    # The profiler alone: overlapkit names its ranges whenever one runs. A recorder would add its own
    # work to what is measured (a completion watcher per rank; the pipeline's per-step bubble exchange).
    with prof:
        for _ in range(steps + 2):  # warm-up, the measured steps, one the reader drops
            idx = torch.randint(0, vocab, (mb * m, seq), generator=gen).to(dev)
            tgt = torch.randint(0, vocab, (mb * m, seq), generator=gen).to(dev)
            for c in chunks:
                c.zero_grad(set_to_none=False)
            # bf16 autocast on the GPU (what the cost model prices); fp32 on the CPU, whose bf16 GEMMs are slow
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
                if pp > 1:
                    engine.step(idx, tgt)
                elif arch == "llama":
                    model(input_ids=idx, labels=tgt).loss.backward()
                else:
                    lm_loss(model(idx), tgt).backward()
            clip_grad_norm_(params, 1.0, group=groups.pp if pp > 1 else None)
            opt.step()
            if device == "cuda":
                torch.cuda.synchronize()
            prof.step()
    return {"rank": groups.rank}


def measure(sizes: dict, layout: tuple, steps: int, overlap: str, device: str, timeout_s: float,
            folder: str | None = None, arch: str = "gpt") -> str:
    """Run one layout on its ranks (unless `folder` already holds its traces); returns the traces' folder."""
    from _lib.unexported import spawn

    tp, pp, dp, _, _ = layout
    if folder and Path(folder).is_dir() and any(Path(folder).glob("rank*.json")):
        return folder  # --reuse: traced before
    folder = folder or tempfile.mkdtemp(prefix="calibrate_validation_")
    os.makedirs(folder, exist_ok=True)
    if device == "cuda":
        spawn(run_rank, 1, sizes, layout, steps, folder, overlap, device, arch, backend="nccl", timeout_s=timeout_s)
    else:
        spawn(run_rank, tp * pp * dp, sizes, layout, steps, folder, overlap, device, arch, timeout_s=timeout_s)
    return folder


def measure_limited(name: str, folder: str, argv: list[str], limit_s: float) -> str | None:
    """Trace layout `name` into `folder` in a process session of its own (this script, `--only`); None when it
    finished, else why not. A session that outlives `limit_s` is killed whole: its ranks and their server."""
    if any(Path(folder).glob("rank*.json")):
        return None  # traced before (--traces)
    os.makedirs(folder, exist_ok=True)
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--only", name, "--into", folder]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return f"did not finish in {limit_s:.0f} s (killed; a rank stalled outside any collective's timeout)"
    if proc.returncode != 0:
        lines = [x for x in out.splitlines() if x.strip() and "USDT" not in x]
        return f"exit {proc.returncode}: " + " | ".join(lines[-3:])
    return None


def model_json(sizes: dict, arch: str = "gpt") -> dict:
    """The run's model in the cost model's keys."""
    llama = arch == "llama"
    return {"hidden": sizes["hidden"], "ffn_hidden": sizes["ffn_hidden"], "num_layers": sizes["num_layers"],
            "num_heads": sizes["num_heads"], "num_kv_heads": sizes["num_heads"] // 2 if llama else 0,
            "seq_len": sizes["seq_len"], "vocab_size": sizes["vocab_size"], "gated_mlp": llama,
            "tied_embeddings": False, "name": "HF Llama" if llama else "overlapkit GPT"}


def par_of(layout: tuple, overlap: str, device: str = "cuda"):
    """The layout, stepped as run_rank steps it: eager, gradients kept (zero_grad(set_to_none=False)), fp32
    parameters under autocast on the GPU (the CPU runs fp32 alone: the fitted rates absorb bf16's ratio)."""
    from overlapkit.costmodel import Overlap, ParallelConfig

    tp, pp, dp, mb, m = layout
    return ParallelConfig(tp=tp, pp=pp, dp=dp, micro_batch=mb, global_batch=mb * m * dp, sp=tp > 1,
                          overlap=Overlap(tp=overlap, dp="bulk", pp="bulk"), eager=True, grad_accumulation="kept",
                          weights="autocast" if device == "cuda" else "master")


def cores() -> int:
    """The cores this process may run on (a lane pinned by taskset has fewer than the machine)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def plan_of(device: str, kind: str, arch: str, world: int) -> dict:
    """The layouts of a run, the traced one first."""
    b = SIZES[kind]["batch"]
    if device == "cuda":
        return {f"micro-batch {b} (traced)": (1, 1, 1, b, 1), **{f"micro-batch {x}": (1, 1, 1, x, 1)
                                                                 for x in (b // 4, b // 2, 2 * b) if x >= 1}}
    return layouts(b, arch, world)


def run(device: str, kind: str, steps: int, overlap: str, timeout_s: float, traces: str | None = None,
        arch: str = "gpt", world: int = 4, argv: list[str] | None = None, limit_s: float = 0.0,
        on_row=lambda res: None) -> dict:
    """Trace the first layout, calibrate on it, predict and trace the others; `on_row(results so far)` after each."""
    from _lib.unexported import fit, predict_calibrated, read_measured, terms
    from overlapkit.costmodel import ModelConfig, predict, preset

    sizes = SIZES[kind]
    model = ModelConfig(**model_json(sizes, arch))
    plan = plan_of(device, kind, arch, world)
    traces = traces or tempfile.mkdtemp(prefix="calibrate_validation_")
    res = {"failed": [], "device": device, "kind": kind, "arch": arch, "model": model_json(sizes, arch),
           "steps": steps, "overlap": overlap, "world": 1 if device == "cuda" else world, "cores": cores(),
           "calibration": None, "rows": []}
    cal = None
    for i, (name, layout) in enumerate(plan.items()):
        folder = os.path.join(traces, "".join(c if c.isalnum() else "_" for c in name))
        why = measure_limited(name, folder, argv or [], limit_s) if limit_s > 0 else None
        measured = None
        if why is None:
            try:
                measured = read_measured(measure(sizes, layout, steps, overlap, device, timeout_s, folder, arch))
            except Exception as e:  # noqa: BLE001 - a rank failed, or its traces cannot be used: say which
                why = f"{type(e).__name__}: {getattr(e, 'summary', None) or str(e).splitlines()[0]}"
        if measured is None:
            if i == 0:
                raise SystemExit(f"the traced layout {name} gave nothing to calibrate on: {why}")
            res["failed"].append({"layout": name, "error": why})
            print(f"{name}: FAILED: {why}", flush=True)
            on_row(res)
            continue
        par = par_of(layout, overlap, device)
        if i == 0:
            cal = fit(measured, model, par, preset("h200-sxm"))
            res["calibration"] = cal.to_dict()
        r = predict_calibrated(cal, model, par)
        err = 100 * (r.step_ms - measured.step_ms) / measured.step_ms
        # the H200 preset as shipped, uncalibrated: how far its short-run curves (sustained clock 1.0) are
        # from a real step on our H200 (CUDA rows only; a CPU run has no preset)
        preset_ms = predict(model, par, preset("h200-sxm")).step_ms if device == "cuda" else None
        res["rows"].append({
            "preset_ms": preset_ms, "layout": name, "tp": layout[0], "pp": layout[1], "dp": layout[2],
            "micro_batch": layout[3], "micro_batches": layout[4], "measured_ms": measured.step_ms,
            "predicted_ms": r.step_ms, "error_pct": err, "traced": i == 0,
            # the host's own time a step (a GPU trace): the same ops at every micro-batch, so a busy time that
            # grows with the GPU's work is waiting the reader did not set apart
            "host_busy_ms": measured.host_busy_ms,
            # the optimizer step's compute a step (torch's Optimizer.step range), set apart from the fitted rates
            "optimizer_ms": measured.optimizer_ms, "predicted_optimizer_ms": r.optimizer_ms,
            # term -> [measured ms, predicted ms]: where a miss comes from
            "terms": {k: list(v) for k, v in terms(measured, r).items()},
            # kind -> [comm ms, exposed ms, calls] per step
            "measured_comm": {k: list(v[:3]) for k, v in measured.comm.items()},
            "predicted_comm": {k: [c, r.exposed_by_kind.get(k, 0.0)] for k, c in r.comm_by_kind.items()}})
        res["rows"][-1]["measured"] = measured.to_record()
        if device == "cuda":  # the GPU's kernels by time: the per-step work the model may not price, by name
            from _lib.kernel_table import kernel_table
            try:
                res["rows"][-1]["kernels"] = kernel_table(os.path.join(folder, "rank0.json"), steps + 1)
            except (OSError, ValueError) as e:  # a listing that cannot be read costs the row nothing
                res["rows"][-1]["kernels"] = f"not read: {e}"
        print(f"{name}: measured {measured.step_ms:.1f} ms, predicted {r.step_ms:.1f} ms ({err:+.1f}%)", flush=True)
        res["summary"] = summary(res)
        on_row(res)
    res["summary"] = summary(res)
    return res


def reprice(path: str) -> dict:
    """A committed run's rows priced again by the model as it is now, the calibration refitted on the traced
    row: from each row's `measured` (what the trace reader gave), or, in runs recorded before it was kept, from
    the step, compute, idle and host busy time alone (runs without collectives or named GEMMs: the GPU at ws 1)."""
    from _lib.unexported import Measured, fit, predict_calibrated, terms
    from overlapkit.costmodel import ModelConfig, preset

    res = json.loads(Path(path).read_text())
    kept = all("measured" in r for r in res["rows"])  # what the trace reader gave, kept since 2026-12-07
    if not kept and (any(r["measured_comm"] for r in res["rows"]) or (res["calibration"] or {}).get("gemm_points")):
        raise SystemExit(f"{path}: rows with collectives or named GEMMs need their traces (--traces) to be repriced")
    model, cal = ModelConfig(**res["model"]), None
    for r in res["rows"]:
        if kept:
            measured = Measured.from_record(r["measured"])
        else:
            measured = Measured(step_ms=r["measured_ms"], compute_ms=r["terms"]["compute"][0],
                                idle_ms=r["terms"]["host"][0], device="gpu", host_busy_ms=r["host_busy_ms"],
                                optimizer_ms=r.get("optimizer_ms"))  # rows recorded before it was read: None
        par = par_of((r["tp"], r["pp"], r["dp"], r["micro_batch"], r["micro_batches"]), res["overlap"], res["device"])
        if r["traced"]:
            cal = fit(measured, model, par, preset("h200-sxm"))
            res["calibration"] = cal.to_dict()
        p = predict_calibrated(cal, model, par)
        r.update(predicted_ms=p.step_ms, error_pct=100 * (p.step_ms - r["measured_ms"]) / r["measured_ms"],
                 terms={k: list(v) for k, v in terms(measured, p).items()})
    res["summary"], res["repriced_from"] = summary(res), os.path.basename(path)
    return res


def summary(res: dict) -> dict:
    others = [abs(r["error_pct"]) for r in res["rows"][1:]] or [float("nan")]
    return {"mean_abs_pct": statistics.mean(others), "max_abs_pct": max(others),
            "target_pct": 5.0 if res["device"] == "cuda" else 10.0}


def markdown(res: dict) -> str:
    s = res.get("summary") or summary(res)
    rows = res["rows"]
    traced = rows[0]["layout"] if rows else "none"
    out = [f"Calibrated on one traced layout ({traced}), {res['device']}, {res['cores']} cores, world {res['world']}, "
           f"{res['model']['name']} {res['model']['hidden']} wide x {res['model']['num_layers']} layers, seq {res['model']['seq_len']}, "
           f"TP overlap {res['overlap']}, {res['steps']} measured steps per layout: the other layouts' |error| "
           f"mean {s['mean_abs_pct']:.1f}%, max {s['max_abs_pct']:.1f}% (target: each within {s['target_pct']:.0f}%)."
           + (f" Repriced without a run: {res['repriced_from']}'s recorded rows, calibrated again and predicted by "
              "the model as it is now." if res.get("repriced_from") else ""), "",
           "Per term, measured / predicted ms: compute; exposed communication (the pipeline's aside); the pipeline "
           "(bubble and exposed pipeline transfers); host (idle, and exposed kinds the model has no counterpart for).", "",
           "| layout | tp | pp | dp | micro-batch x count | measured ms | predicted ms | error % | compute | exposed | "
           "pipeline | host |", "|---|---:|---:|---:|---|---:|---:|---:|---|---|---|---|"]
    for r in rows:
        t = r["terms"]
        out.append(f"| {r['layout']} | {r['tp']} | {r['pp']} | {r['dp']} | {r['micro_batch']} x {r['micro_batches']} | "
                   f"{r['measured_ms']:.1f} | {r['predicted_ms']:.1f} | {r['error_pct']:+.1f} | "
                   + " | ".join(f"{t[k][0]:.1f} / {t[k][1]:.1f}" for k in ("compute", "exposed", "pipeline", "host"))
                   + " |")
    out += [f"| {f['layout']} | | | | | failed: {f['error']} | | | | | | |" for f in res["failed"]]
    if res["device"] == "cuda" and rows:
        out += ["", "World size 1: no collective runs, so the TP overlap modes are one program here. The h200-sxm "
                "preset as shipped (uncalibrated, sustained clock 1.0) against the same steps: "
                + ", ".join(f"{r['layout']} {100 * (r['preset_ms'] - r['measured_ms']) / r['measured_ms']:+.1f}%"
                            for r in rows) + "."]
        if all(r.get("host_busy_ms") is not None for r in rows):
            out += ["", "The host's busy time a step (each ProfilerStep less its waits for the GPU: synchronizations "
                    "and launches that waited for room in the queue), the same ops at every micro-batch: "
                    + ", ".join(f"{r['layout']} {r['host_busy_ms']:.1f} ms" for r in rows) + "."]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--world", type=int, default=None, help="ranks of the CPU layouts: 4 (default) or 2 (--smoke)")
    ap.add_argument("--model", choices=("gpt", "llama"), default="gpt",
                    help="overlapkit's GPT, or a Hugging Face Llama through overlapkit.parallelize")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP + " (2 ranks)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per layout (default 5; smoke 2)")
    ap.add_argument("--overlap", default="bulk", choices=("none", "bulk", "pipelined"))
    ap.add_argument("--timeout", type=float, default=120.0, help="process-group timeout per layout, s")
    ap.add_argument("--layout-limit", type=float, default=240.0,
                    help="wall-clock limit per layout, s (0: none); a layout past it is killed and recorded as failed")
    ap.add_argument("--traces", metavar="DIR", help="keep each layout's traces in DIR/<layout>; a layout whose "
                    "folder already holds traces is not run again (re-analysis)")
    ap.add_argument("--reprice", metavar="JSON", help="price a committed run's recorded rows again with the model "
                    "as it is now (no run; older runs: the GPU at world size 1 only); writes <its name>_repriced.{json,md}")
    ap.add_argument("--only", help=argparse.SUPPRESS)  # one layout's traces into --into (measure_limited)
    ap.add_argument("--into", help=argparse.SUPPRESS)
    add_out_arg(ap)
    args = ap.parse_args(argv)
    world = args.world or (2 if args.smoke else 4)
    if args.device == "cpu" and world not in (2, 4):
        print("--world: the CPU layouts are made for 4 ranks (dp2 x tp2 traced) or 2 (tp2 traced)", file=sys.stderr)
        return 2
    kind = "smoke" if args.smoke else args.device
    steps = args.steps or (2 if args.smoke else 5)
    if args.reprice:
        write_results(reprice(args.reprice), os.path.join(out_dir(args), Path(args.reprice).stem + "_repriced"),
                      markdown)
        return 0
    if args.only:
        layout = plan_of(args.device, kind, args.model, world)[args.only]
        measure(SIZES[kind], layout, steps, args.overlap, args.device, args.timeout, args.into, args.model)
        return 0
    out = Path(out_dir(args))
    out.mkdir(parents=True, exist_ok=True)
    stem = f"calibrate_validation_{args.device}_{args.model}" + ("_smoke" if args.smoke else "")
    child = ["--device", args.device, "--model", args.model, "--world", str(world), "--steps", str(steps),
             "--overlap", args.overlap, "--timeout", str(args.timeout)] + (["--smoke"] if args.smoke else [])

    def write(res: dict) -> None:
        (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
        (out / f"{stem}.md").write_text(markdown(res))

    res = run(args.device, kind, steps, args.overlap, args.timeout, args.traces, args.model, world,
              argv=child, limit_s=args.layout_limit, on_row=write)
    write(res)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
