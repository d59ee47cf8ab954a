"""The cost model against 30 published training steps, each priced by `overlapkit plan` as a user runs it.

Every case of tests/data/published_steps/cases.json (or --cases) becomes an `overlapkit plan --json` command
line: the split and batch cases.json gives, `--stack` naming its source's framework, and the flags its source
states (benchmarks/_lib/published_settings.py, each with where it is stated); `plan_json` runs it through the
CLI's own parsing and default-filling, so that what is validated is what a user runs. The published TFLOP/s
per GPU becomes a step time under the source's FLOP convention; the error table per source goes to
benchmarks/results/model_vs_published.{json,md} (each row with its command and the assumptions `plan` made);
`--update-docs` also refreshes the table in docs/model.md. It also predicts the held-out validation sets
(tests/data/published_steps/korthikanti22.json, and megatron_core_moe.json: a published MoE step) and prints the 30-case mean a second time with every
source held out of anything fitted. Nothing is fitted on a case.

    python benchmarks/model_vs_published.py [--cases FILE] [--out benchmarks/results] [--update-docs]

Runs on CPU in under a minute (it predicts; the measurements are publications).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _lib (with the settings and deepspeed_pipe.py) lives beside it
from _lib.common import ROOT as _ROOT, SMOKE_HELP, TEST_DATA, out_dir  # noqa: E402
from _lib.unexported import POWER_LIMIT_CLOCK, SUSTAINED_CLOCK, hardware, step_flops  # noqa: E402
from overlapkit.costmodel import ModelConfig, Overlap, ParallelConfig, predict, preset  # noqa: E402
from _lib.published_settings import SOURCES, describe, source_flags  # noqa: E402
from _lib.unexported import parse_plan_args, plan_inputs, plan_json  # noqa: E402

ROOT = Path(_ROOT)
DOCS_BEGIN, DOCS_END = "<!-- model_vs_published:begin -->", "<!-- model_vs_published:end -->"


def published_dir(arg: str | None) -> Path | None:
    for d in ([Path(arg)] if arg else [Path(TEST_DATA) / "published_steps"]):
        if (d / "cases.json").is_file():
            return d
    return None


def plan_argv(case: dict, folder: str, **design) -> list[str]:
    """The `overlapkit plan` command line of a case: cases.json's split and batch, its model written to
    `folder`, then its source's --stack and stated flags (published_settings.py)."""
    src = SOURCES[case["source"]]
    model = {**case["model"], **src.get("model", {}), "name": f"{case['source']} {case['case']}"}
    path = Path(folder) / "model.json"
    path.write_text(json.dumps(model))
    argv = ["--model", str(path), "--hardware", case["hardware"]]
    for flag in ("tp", "pp", "vpp", "dp", "cp", "ep", "micro_batch", "global_batch", "recompute", "zero"):
        if flag in case:
            argv += [f"--{flag.replace('_', '-')}", str(case[flag])]
    argv.append("--sp" if case["sp"] else "--no-sp")
    for engine, mode in case["overlap"].items():
        argv += [f"--overlap-{engine}", mode]
    return argv + source_flags(case["source"], case["case"], **design)


def config(case: dict, extra: tuple[str, ...] = ()) -> tuple[ModelConfig, ParallelConfig, str]:
    """The model, split and hardware `overlapkit plan` prices for a case (and `extra` flags)."""
    with tempfile.TemporaryDirectory() as folder:
        inputs = plan_inputs(parse_plan_args(plan_argv(case, folder) + list(extra)))
    return inputs.model, inputs.par, inputs.hardware


def published_step_s(case: dict, gpus: int) -> float:
    """The published step time, or the one its TFLOP/s per GPU implies under its FLOP convention."""
    pub = case["published"]
    if "step_s" in pub:
        return pub["step_s"]
    f = step_flops(ModelConfig(**case["model"]), case["global_batch"], case["flops"], case.get("flops_layers"))
    return f / (pub["tflops"] * 1e12 * gpus)


def cp16_case(not_run: list[dict]) -> dict | None:
    """Llama 3's CP16 row (128K context), now expressible: the 405B model at seq 131072."""
    row = next((r for r in not_run if r.get("cp")), None)
    if row is None:
        return None
    model = {"hidden": 16384, "ffn_hidden": 53248, "num_layers": 128, "num_heads": 128, "seq_len": row["seq_len"],
             "vocab_size": 128256, "gated_mlp": True, "tied_embeddings": False, "num_kv_heads": 8}
    return {"source": row["source"], "case": row["case"], "model": model, "hardware": "h100-sxm", "tp": row["tp"],
            "cp": row["cp"], "pp": row["pp"], "vpp": 1, "dp": row["dp"], "micro_batch": 1,
            "global_batch": row["dp"] * row["batch_per_dp"], "recompute": "none", "sp": True, "zero": 2,
            "overlap": {"tp": "auto", "dp": "bulk", "pp": "bulk", "zero": "pipelined", "cp": "pipelined"},
            "flops": "palm", "flops_layers": 126, "published": row["published"]}


# torchtitan's async-TP benchmark (benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md), vanilla TP,
# bf16, on the same 500 W HBM2e H100s: what POWER_LIMIT_CLOCK is calibrated on (not one of the 30).
POWER_LIMIT_RUNS = (("llama3-70b", 32, 16, "full", 597.3), ("llama3-8b", 8, 12, "op", 4378.0))
# (these are the source "torchtitan-asyncTP" of FITTED below: not one of the published steps)
"""(model, FSDP size, local batch, activation checkpointing, tokens/s per GPU) at TP 8, seq 8192, compiled."""


def power_limit_rows(runs=POWER_LIMIT_RUNS, clock: float | None = None) -> list[dict]:
    """The async-TP runs predicted (with the 500 W H100 at `clock` instead of POWER_LIMIT_CLOCK, if given)."""
    from overlapkit.costmodel import MODEL_PRESETS

    hw = preset("h100-sxm-500w")
    if clock is not None:
        hw = replace(hw, gemm=replace(hw.gemm, peak_fraction=hw.gemm.peak_fraction * clock / POWER_LIMIT_CLOCK),
                     attention=replace(hw.attention, peak_fraction=hw.attention.peak_fraction * clock / POWER_LIMIT_CLOCK))
    rows = []
    for name, dp, batch, ac, tps in runs:
        par = ParallelConfig(tp=8, dp=dp, micro_batch=batch, global_batch=batch * dp, recompute=ac, zero=3,
                             grad_bytes=4, zero3_prefetch=1, attention="flash2",
                             overlap=Overlap(dp="bulk", zero="pipelined"))
        r = predict(MODEL_PRESETS[name], par, hw)
        measured = batch * 8192 / (tps * 8)  # tokens/s per GPU: a TP group of 8 shares one batch
        pred = r.step_ms * 1e-3
        rows.append({"source": "torchtitan async-TP (calibration)", "case": f"{name} FSDP{dp} TP8", "hardware":
                     "h100-sxm-500w", "gpus": par.world, "published_s": measured, "predicted_s": pred,
                     "error_pct": 100.0 * (pred - measured) / measured, "compute_s": r.compute_ms * 1e-3,
                     "exposed_s": r.exposed_ms * 1e-3, "bubble_s": r.bubble_ms * 1e-3, "host_s": r.host_ms * 1e-3,
                     "fits": r.memory["fits"], "memory_gib": r.memory["total_gib"]})
    return rows


def run_case(case: dict, extra: tuple[str, ...] = (), **design) -> dict:
    """One case predicted by `overlapkit plan --json` with its source's stack and stated flags (`design`:
    source_flags' switches for the other designs)."""
    with tempfile.TemporaryDirectory() as folder:
        argv = plan_argv(case, folder, **design) + list(extra)
        d = plan_json(argv)
    measured = published_step_s(case, d["parallel"]["world"])
    pred = d["step_time_s"]
    return {"source": case["source"], "case": case["case"], "hardware": d["hardware"], "gpus": d["parallel"]["world"],
            "published_s": measured, "predicted_s": pred, "error_pct": 100.0 * (pred - measured) / measured,
            "compute_s": d["compute_s"], "exposed_s": d["exposed_comm_s"], "bubble_s": d["bubble_s"],
            "host_s": d["host_s"], "fits": d["memory"]["fits"], "memory_gib": d["memory"]["total_gib"],
            "command": "overlapkit plan " + " ".join(a if not a.endswith("model.json") else "MODEL.json" for a in argv),
            "assumptions": {a["setting"]: [a["value"], a["from"]] for a in d["assumptions"]}}


def power_limit_loss(clock: float, runs=POWER_LIMIT_RUNS) -> float:
    """Sum of squared log step-time errors over the async-TP runs with the 500 W H100 at `clock`."""
    loss = 0.0
    for row in power_limit_rows(runs, clock):
        loss += math.log(row["predicted_s"] / row["published_s"]) ** 2
    return loss


def fit_power_limit_clock(runs=POWER_LIMIT_RUNS) -> float:
    """Least-squares POWER_LIMIT_CLOCK over `runs` (golden-section search: the loss is unimodal in the clock;
    25 steps narrow [0.5, 1] to 3e-6): how hardware.POWER_LIMIT_CLOCK was calibrated."""
    g = (math.sqrt(5) - 1) / 2
    lo, hi = 0.5, 1.0
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = power_limit_loss(a, runs), power_limit_loss(b, runs)
    for _ in range(25):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = power_limit_loss(a, runs)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = power_limit_loss(b, runs)
    return (lo + hi) / 2


FITTED = {"POWER_LIMIT_CLOCK": {"fitted_on": "torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md",
                                "sources": ("torchtitan-asyncTP",)}}
"""Every constant of the model that is still fitted to a training step (the others come from our H200 probes,
datasheets, published micro-benchmarks or physics: docs/model.md), with the sources of the runs it is fitted on.
A held-out pass refits each one without the held-out source's runs."""


def with_clocks(power_limit: float):
    """Install a POWER_LIMIT_CLOCK (and what is derived from it: the 700 W H100's sustained clock) in the
    hardware presets; returns the previous value to restore."""
    old = hardware.POWER_LIMIT_CLOCK
    hardware.POWER_LIMIT_CLOCK = power_limit
    hardware.SUSTAINED_CLOCK["h100-sxm"] = hardware.power_limited_clock(hardware.H100_TDP_W, anchor_clock=power_limit)
    hardware.preset.cache_clear()
    return old


def held_out(cases: list[dict]) -> dict:
    """Each source's cases predicted with every fitted constant refit on runs from the OTHER sources only
    (FITTED: none is fitted on the published steps, so each refit uses all its runs and the two means can
    differ only by the refit's own rounding). Returns {source: {errors, constants}} and the summary."""
    out = {}
    for source in dict.fromkeys(c["source"] for c in cases):
        runs = tuple(r for r in POWER_LIMIT_RUNS if source not in FITTED["POWER_LIMIT_CLOCK"]["sources"])
        clock = fit_power_limit_clock(runs)
        old = with_clocks(clock)
        try:
            errs = [run_case(c)["error_pct"] for c in cases if c["source"] == source]
        finally:
            with_clocks(old)
        out[source] = {"constants": {"POWER_LIMIT_CLOCK": clock}, "errors": errs,
                       "mean_abs_pct": statistics.mean(map(abs, errs)), "max_abs_pct": max(map(abs, errs))}
    errs = [abs(e) for x in out.values() for e in x["errors"]]
    return {"by_source": out, "summary": {"cases": len(errs), "mean_abs_pct": statistics.mean(errs),
                                          "max_abs_pct": max(errs)}}


def designs(cases: list[dict]) -> list[dict]:
    """The cases through the command under the other designs, beside the adopted one: what the stacks and
    the README's stated PP overlap each change (docs/model.md)."""
    def bf16(c):
        return ("--grad-dtype", "bf16") if SOURCES[c["source"]]["stack"] == "megatron-core-2024" else ()
    out = []
    for name, run in (("the command with each source's stated flags only, no stack",
                       lambda c: run_case(c, stack=False)),
                      ("stacks as documented, cases.json's vpp = 1 for the README rows",
                       lambda c: run_case(c, interleaved=False)),
                      ("adopted: stacks as documented, the README's pipelined rows interleaved", run_case),
                      ("adopted, with the Megatron-Core rows reducing gradients in bf16 (not r0.8's behaviour)",
                       lambda c: run_case(c, bf16(c)))):
        errs = [abs(run(c)["error_pct"]) for c in cases]
        out.append({"design": name, "mean_abs_pct": statistics.mean(errs), "max_abs_pct": max(errs)})
    return out


def bf16_reduce_rows(cases: list[dict]) -> list[dict]:
    """The Megatron-Core rows with gradients reduced in bf16 (`--grad-dtype bf16`) instead of the stack's fp32
    (r0.8 forces fp32 under bf16; --grad-reduce-in-bf16 came later): the other design, measured beside."""
    return [dict(run_case(c, ("--grad-dtype", "bf16")), command="--grad-dtype bf16") for c in cases
            if SOURCES[c["source"]]["stack"] == "megatron-core-2024"]


def deepspeed_schedule_rows(cases: list[dict]) -> list[dict]:
    """MT-NLG's pipeline replayed under DeepSpeed's own TrainSchedule (deepspeed_pipe) with the model's
    stage times, beside the model's 1F1B pricing of the same: the schedule's cost, not assumed."""
    from _lib.unexported import p2p_ms
    from _lib.deepspeed_pipe import makespan_ms
    from overlapkit.costmodel import Collectives

    rows = []
    for c in cases:
        if c["source"] != "MT-NLG-530B":
            continue
        model, par, name = config(c)
        hw = preset(name)
        r = predict(model, par, hw)
        fwd = [n * r.layer_fwd.wall_ms + (r.head_fwd.wall_ms if i == par.pp - 1 else 0.0)
               for i, n in enumerate(r.stage_layers)]
        bwd = [t - f for t, f in zip(r.stage_ms, fwd)]
        t = p2p_ms(model, par, hw.for_training(), Collectives(hw.for_training()))
        one_f_one_b = par.micro_batches * max(r.stage_ms) + r.bubble_ms + r.exposed_by_kind.get("pp_send", 0.0)
        rows.append({"case": c["case"], "deepspeed_s": makespan_ms(par.micro_batches, fwd, bwd, t) * 1e-3,
                     "model_1f1b_s": one_f_one_b * 1e-3})
    return rows


def summarize(rows: list[dict]) -> dict:
    by = {}
    for r in rows:
        by.setdefault(r["source"], []).append(abs(r["error_pct"]))
    errs = [abs(r["error_pct"]) for r in rows]
    return {"cases": len(rows), "mean_abs_pct": statistics.mean(errs), "max_abs_pct": max(errs),
            "over_10pct": sum(e > 10 for e in errs),
            "by_source": {k: {"cases": len(x), "mean_abs_pct": statistics.mean(x), "max_abs_pct": max(x)}
                          for k, x in by.items()}}


VALIDATION = ("korthikanti22.json", "megatron_core_moe.json")
"""Held-out published steps (tests/data/published_steps/), used for nothing but being predicted: Korthikanti et al.
2022's eight A100 steps, and Megatron-Core's Mixtral 8x7B step (expert parallelism)."""


def markdown(rows: list[dict], summary: dict, extra: list[dict], bf16: list[dict] = (), held: dict | None = None,
             deepspeed: list[dict] = (), validation: list[tuple] = (), design: list[dict] = ()) -> str:
    s = summary
    out = [f"{s['cases']} published steps through `overlapkit plan --stack ...`: mean |error| {s['mean_abs_pct']:.1f}%, "
           f"max {s['max_abs_pct']:.1f}%, {s['over_10pct']} over 10% (targets: mean <= 5%, per source <= 8%, max <= 12%)."]
    if design:
        out += ["", "| design (the same cases, the same command) | mean abs error % | max abs error % |", "|---|---:|---:|"]
        out += [f"| {d['design']} | {d['mean_abs_pct']:.1f} | {d['max_abs_pct']:.1f} |" for d in design]
    if held:
        h = held["summary"]
        out += ["", f"With every source held out of anything fitted (each constant of FITTED refit without that "
                f"source's runs): mean |error| {h['mean_abs_pct']:.1f}%, max {h['max_abs_pct']:.1f}% "
                f"({abs(h['mean_abs_pct'] - s['mean_abs_pct']):.2f} points from the mean as is; target: within 1). "
                "Fitted constants and the runs they are fitted on: "
                + "; ".join(f"{k} on {x['fitted_on']}" for k, x in FITTED.items())
                + "; refit values per held-out source: "
                + ", ".join(f"{src} {x['constants']['POWER_LIMIT_CLOCK']:.3f}" for src, x in held["by_source"].items())
                + "."]
    for name, rows_v in validation:
        v = summarize(rows_v)
        out += ["", f"Held-out validation set ({v['cases']} further published step{'s' if v['cases'] > 1 else ''}, never "
                f"used for anything above: tests/data/published_steps/{name}): mean |error| {v['mean_abs_pct']:.1f}%, "
                f"max {v['max_abs_pct']:.1f}%.", "",
                "| source | case | hardware | GPUs | published s | predicted s | error % | compute s | exposed s "
                "| bubble s | host s |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        out += [f"| {r['source']} | {r['case']} | {r['hardware']} | {r['gpus']} | {r['published_s']:.3f} | "
                f"{r['predicted_s']:.3f} | {r['error_pct']:+.1f} | {r['compute_s']:.3f} | {r['exposed_s']:.3f} | "
                f"{r['bubble_s']:.3f} | {r['host_s']:.3f} |" for r in rows_v]
    out += ["",
           "| source | stack | cases | mean abs error % | max abs error % |", "|---|---|---:|---:|---:|"]
    out += [f"| {k} | {SOURCES[k]['stack']} | {x['cases']} | {x['mean_abs_pct']:.1f} | {x['max_abs_pct']:.1f} |"
            for k, x in s["by_source"].items()]
    out += ["", "| source | case | hardware | GPUs | published s | predicted s | error % | compute s | exposed s "
                "| bubble s | host s |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows + extra:
        out.append(f"| {r['source']} | {r['case']} | {r['hardware']} | {r['gpus']} | {r['published_s']:.3f} | "
                   f"{r['predicted_s']:.3f} | {r['error_pct']:+.1f} | {r['compute_s']:.3f} | {r['exposed_s']:.3f} | "
                   f"{r['bubble_s']:.3f} | {r['host_s']:.3f} |")
    if extra:
        out += ["", "Below the 30: Llama 3's CP16 row (cases.json lists it as not run) priced with `--cp 16`, and "
                "the two torchtitan async-TP runs the 500 W H100's matmul share (0.70) is calibrated on "
                "(least squares over both)."]
    if bf16:
        out += ["", "The Megatron-Core rows with gradients reduced in bf16 instead of the stack's fp32 (not r0.8's "
                "behaviour; the settings this table used before the stacks): "
                + ", ".join(f"{r['case']} {r['error_pct']:+.1f}%" for r in bf16)
                + f" (these {len(bf16)}: mean |error| {statistics.mean(abs(r['error_pct']) for r in bf16):.1f}%)."]
    if deepspeed:
        out += ["", "MT-NLG's pipeline replayed under DeepSpeed's TrainSchedule (benchmarks/_lib/deepspeed_pipe.py: step-paired, "
                "blocking, unbatched sends) with the model's stage times, against the model's 1F1B pricing of the "
                "same (slowest stage x m + fill/drain + exposed p2p): "
                + ", ".join(f"{r['case']} {r['deepspeed_s']:.2f} s vs {r['model_1f1b_s']:.2f} s" for r in deepspeed)
                + ". The schedule is not what the MT-NLG rows miss."]
    out += ["", "Sustained clocks (hardware.SUSTAINED_CLOCK, derived, not fitted): "
            + ", ".join(f"{k} {v:.3f}" for k, v in SUSTAINED_CLOCK.items())
            + f" (the 700 W H100: the 500 W measurement POWER_LIMIT_CLOCK {POWER_LIMIT_CLOCK} along P ~ f^3; the "
            "A100: its published MAMF as measured); the 500 W H100 runs at POWER_LIMIT_CLOCK, the H200 at 1.0."]
    out += ["", "Each source's `overlapkit plan` flags beyond cases.json (benchmarks/_lib/published_settings.py; "
            "the stacks: src/overlapkit/costmodel/data/stacks/):", "", "| source | stack and stated flags |", "|---|---|"]
    out += [f"| {k} | {describe(k)} |" for k in SOURCES]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", help="folder with cases.json (default: tests/data/published_steps)")
    ap.add_argument("--validation", nargs="*", default=[str(ROOT / "tests" / "data" / "published_steps" / name)
                                                          for name in VALIDATION],
                    help="held-out validation cases (files in cases.json's format), each reported beside the table")
    ap.add_argument("--out", default=None, help="results folder (default: benchmarks/results; with --smoke a new "
                                                "temporary folder)")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP + " (here: the held-out refits on one source)")
    ap.add_argument("--update-docs", action="store_true", help="rewrite the table block in docs/model.md")
    ap.add_argument("--fit-power-limit", action="store_true",
                    help="print the least-squares POWER_LIMIT_CLOCK over the async-TP runs (its calibration)")
    args = ap.parse_args(argv)
    if args.smoke and args.update_docs:
        ap.error("--smoke writes nothing outside its results folder: not with --update-docs")
    if args.fit_power_limit:
        print(f"POWER_LIMIT_CLOCK least squares: {fit_power_limit_clock():.4f} (shipped {POWER_LIMIT_CLOCK})")
        return 0
    folder = published_dir(args.cases)
    if folder is None:
        print("no published_steps/cases.json found; pass --cases", file=sys.stderr)
        return 2
    data = json.loads((folder / "cases.json").read_text())
    rows = [run_case(c) for c in data["cases"]]
    cp = cp16_case(data.get("not_run", []))
    extra = ([run_case(cp)] if cp else []) + power_limit_rows()
    summary = summarize(rows)
    bf16 = bf16_reduce_rows(data["cases"])
    first = data["cases"][0]["source"]
    held = held_out([c for c in data["cases"] if c["source"] == first] if args.smoke else data["cases"])
    deepspeed = deepspeed_schedule_rows(data["cases"])
    validation = [(Path(p).name, [run_case(c) for c in json.loads(Path(p).read_text())["cases"]])
                  for p in args.validation if Path(p).is_file()]
    design = [] if args.smoke else designs(data["cases"])
    text = markdown(rows, summary, extra, bf16, held, deepspeed, validation, design)
    out = Path(out_dir(args))
    out.mkdir(parents=True, exist_ok=True)
    (out / "model_vs_published.json").write_text(json.dumps(
        {"summary": summary, "rows": rows, "extra": extra, "megatron_core_bf16_reduce": bf16, "designs": design, "held_out": held,
         "fitted": FITTED, "validation": {name: {"summary": summarize(v), "rows": v} for name, v in validation},
         "mt_nlg_deepspeed_schedule": deepspeed, "sustained_clock": dict(SUSTAINED_CLOCK),
         "power_limit_clock": POWER_LIMIT_CLOCK,
         "settings": {k: describe(k) for k in SOURCES}},
        indent=1))
    (out / "model_vs_published.md").write_text(text)
    print(text)
    if args.update_docs:
        docs = ROOT / "docs" / "model.md"
        body = docs.read_text()
        a, b = body.index(DOCS_BEGIN) + len(DOCS_BEGIN), body.index(DOCS_END)
        docs.write_text(body[:a] + "\n" + text + body[b:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
