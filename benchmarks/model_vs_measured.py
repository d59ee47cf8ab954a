"""The cost model against measurements: predicted vs measured, error %, side by side.

What the model predicts — GEMM, chunked-GEMM, attention and memory-bound times on H200, the
seeds' worked examples, Flux's AG+GEMM / GEMM+RS times, PyTorch async-TP's speed-ups, and the
engines' own benchmarks where they have run — next to what was measured, with the error.
H200 rows are held out of the fit (see overlapkit.costmodel.calibration): the model never saw them.

    python benchmarks/model_vs_measured.py                 # tables -> benchmarks/results/
    python benchmarks/model_vs_measured.py --update-docs   # also refresh docs/model.md's table
    python benchmarks/model_vs_measured.py --write-preset  # refit data/h200-sxm.json first

Runs on CPU (it predicts; the measurements are files). Reads tests/data/calibration (the H200
probe and GEMM grid) unless --calibration names another folder. `--write-preset` and `--update-docs`
write outside benchmarks/results, on purpose: the shipped preset and docs/model.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _lib.common import ROOT as _ROOT, SMOKE_HELP, TEST_DATA, out_dir  # noqa: E402
from _lib.unexported import (FITTED_HIDDEN, HELD_OUT_ATTENTION_TP, Site, add_probe, bucket_sizes, buckets_ms,  # noqa: E402
                             fit_curves, layer_gemms, split_gemm, with_add_probe)
from overlapkit.costmodel import (Collectives, Group, Link, ModelConfig, Overlap, ParallelConfig, load_model,  # noqa: E402
                                  plan_site, predict, preset)

ROOT = Path(_ROOT)
PRESET_JSON = ROOT / "src" / "overlapkit" / "costmodel" / "data" / "h200-sxm.json"
PRESET_SOURCE = ("fitted by benchmarks/model_vs_measured.py --write-preset on calibration/h200_gemm_grid.json "
                 "(one H200, torch 2.11) and, for the elementwise bandwidth, x + y of hbm_add_probe.py "
                 "(data/h200_add_probe.json); GEMM rows with M=2048, TP=8 attention rows and hidden != 8192 "
                 "memory-bound rows held out")
DOCS_ROWS = 30
"""Sections longer than this show their largest errors in docs/model.md (all rows in results/)."""
DOCS_BEGIN, DOCS_END = "<!-- model_vs_measured:begin -->", "<!-- model_vs_measured:end -->"

# Flux (bytedance/flux, README "Performance" / docs/performance_report.md): TP=8, fp16,
# M=4096, K=12288, N=49152 (per rank N/8 for AG+GEMM, K/8 for GEMM+RS), 8 GPUs per machine.
FLUX = {
    ("a800-sxm-80g", "ag_gemm"): dict(gemm=2.438, comm=0.662, total=3.099, flux=2.469),
    ("a800-sxm-80g", "gemm_rs"): dict(gemm=2.453, comm=0.646, total=3.100, flux=2.508),
    ("h800-sxm", "ag_gemm"): dict(gemm=0.846, comm=0.583, total=1.429, flux=0.957),
    ("h800-sxm", "gemm_rs"): dict(gemm=0.818, comm=0.590, total=1.408, flux=0.932),
}
# PyTorch async-TP (discuss.pytorch.org/t/209487, 2024): 64 H100 (power-limited, HBM2e), TP=8
# within a node, FSDP across, bf16, torch.compile; forward speed-up "up to ~29%" (Llama3 8B,
# selective AC) and "~20%" (70B, full AC), E2E ~8% both. torchtitan docs/performance.md (2025):
# E2E 1.10 (8B, FSDP=8, local batch 12) and 1.09 (70B, FSDP=32, local batch 16). Sequence 8192
# (torchtitan's default; the post does not say) and one sequence per forward are assumptions.
ASYNC_TP = {"llama3-8b": dict(fwd=1.29, e2e=1.10, dp=8, batch=12, recompute="selective"),
            "llama3-70b": dict(fwd=1.20, e2e=1.09, dp=32, batch=16, recompute="full")}


def err(pred: float, meas: float) -> float:
    return 100.0 * (pred - meas) / meas


def calibration_dir(arg: str | None) -> Path | None:
    for d in ([Path(arg)] if arg else [Path(TEST_DATA) / "calibration"]):
        if (d / "h200_gemm_grid.json").is_file():
            return d
    return None


def gemm_rows(grid: dict) -> list[dict]:
    hw = preset("h200-sxm")
    _, held = split_gemm(grid)
    return [dict(what=f"GEMM {m}x{k}x{n}", predicted=hw.gemm_ms(m, k, n), measured=ms,
                 roofline=hw.gemm.roofline_ms(m, k, n, hw.bf16_tflops, 2)) for m, k, n, ms in held]


def probe_rows(probe: dict) -> tuple[list[dict], list[dict]]:
    """Chunked-GEMM efficiency (x chunks of m/x rows vs whole) and small-m TFLOP/s."""
    hw = preset("h200-sxm")
    shapes = {"qkv(AG+GEMM)": (8192, 8192, 1280), "fc1(AG+GEMM)": (8192, 8192, 7168),
              "proj(GEMM+RS)": (8192, 1024, 8192), "fc2(GEMM+RS)": (8192, 3584, 8192)}
    chunk = []
    for name, (m, k, n) in shapes.items():
        for x in (2, 4, 8, 16, 32, 64):
            eff = hw.gemm_ms(m, k, n) / (x * hw.gemm_ms(m // x, k, n))
            chunk.append(dict(what=f"{name.split('(')[0]} {x} chunks: efficiency", predicted=eff,
                              measured=probe["gemm"][name][f"x{x}_eff"]))
    small = [dict(what=f"m={m} (K=8192, N=7168): TFLOP/s", predicted=2 * int(m) * 8192 * 7168 / hw.gemm_ms(int(m), 8192, 7168) / 1e9,
                  measured=v["tflops"]) for m, v in probe["small_m"].items()]
    return chunk, small


def attention_memory_rows(grid: dict, adds: dict) -> list[dict]:
    """Held-out attention and memory-bound rows; `adds` is hbm_add_probe's x + x / x + y timing."""
    hw = preset("h200-sxm")
    rows = []
    for a in grid["attention"]:
        if a["tp"] in HELD_OUT_ATTENTION_TP:
            f, b = hw.attention_ms(1, a["heads"], a["seq"], a["head_dim"])
            rows.append(dict(what=f"attention {a['heads']} heads, seq {a['seq']}: fwd", predicted=f, measured=a["fwd_ms"]))
            rows.append(dict(what=f"attention {a['heads']} heads, seq {a['seq']}: fwd+bwd", predicted=f + b,
                             measured=a["fwd_bwd_ms"]))
    xy = {r["hidden"]: r["x_plus_y_ms"] for r in adds["rows"]}
    for r in grid["memory_bound"]:
        n, h = r["tokens"] * r["hidden"], r["hidden"]
        if h != FITTED_HIDDEN:
            rows.append(dict(what=f"layer norm 8192x{h}", predicted=hw.memory.norm_ms(n, 2), measured=r["layernorm_ms"]))
            if h in xy:
                rows.append(dict(what=f"x + y 8192x{h} (3 accesses; add probe)", predicted=hw.memory.elementwise_ms(n, 2),
                                 measured=xy[h]))
        # x + x reads its one operand once: two accesses (calibration.memory_curve); fitted at no h
        rows.append(dict(what=f"x + x 8192x{h} (2 accesses)", predicted=hw.memory.elementwise_ms(n, 2, 2),
                         measured=r["add_ms"]))
    return rows


def worked_examples() -> list[dict]:
    """Seed 002's DP example and seed 003's TP message (the seeds' own numbers as 'measured')."""
    link = Link("50 GB/s per GPU, seed 002", 0.0, 50.0, 1.0)
    hw = replace(preset("h200-sxm"), intra=link, inter=link, sm_comm_slowdown=1.0)
    coll, group = Collectives(hw), Group(8, 1)
    ar = coll.time_ms("all_reduce", 2e9, group, "ring")
    sizes = bucket_sizes(2e9, 25 * 2**20)
    overlapped = 100 + buckets_ms(sizes, 200, lambda b: coll.time_ms("all_reduce", b, group, "ring"), 1.0)
    rows = [dict(what="1B bf16 grads, DP=8 ring all-reduce at 50 GB/s, ms", predicted=ar, measured=70.0),
            dict(what="fwd 100 + bwd 200 + all-reduce, no overlap, ms", predicted=300 + ar, measured=370.0),
            dict(what="same with 25 MiB buckets overlapped, ms", predicted=overlapped, measured=301.0)]
    tp = tp_example("h200-sxm")
    rows.append(dict(what="TP message b=1, s=4096, h=7168 bf16, MB", predicted=tp["message_mb"], measured=58.7))
    for hw_name, dtype in (("h100-sxm", "bf16"), ("h200-sxm", "bf16"), ("h100-sxm", "fp8")):
        t = tp_example(hw_name, dtype)
        rows.append(dict(what=f"its all-reduce / layer GEMMs, TP=8, {hw_name} {dtype} (seed band 0.05-0.6; "
                              f"{t['all_reduce_ms']:.3f} / {t['gemm_ms']:.3f} ms)",
                         predicted=t["ratio"], measured=float("nan")))
    return rows


def tp_example(hardware: str, dtype: str = "bf16") -> dict:
    """Seed 003's TP case: b=1, s=4096, h=7168 (FFN 4h), TP=8: message, one all-reduce, the layer's GEMMs."""
    model = ModelConfig(hidden=7168, ffn_hidden=4 * 7168, num_layers=1, num_heads=56, seq_len=4096,
                        vocab_size=32000, gated_mlp=False, name="seed-003")
    hw = preset(hardware)
    message = 4096 * 7168 * 2
    ar = Collectives(hw).time_ms("all_reduce", message, Group(8, 8))
    gemms = sum(hw.gemm_ms(g.m, g.k, g.n, dtype) for g in layer_gemms(model, ParallelConfig(tp=8, dtype=dtype)))
    return dict(message_mb=message / 1e6, all_reduce_ms=ar, gemm_ms=gemms, ratio=ar / gemms)


def flux_rows() -> list[dict]:
    rows = []
    for (hw_name, pattern), pub in FLUX.items():
        hw = preset(hw_name)
        mkn = (4096, 12288, 6144) if pattern == "ag_gemm" else (4096, 6144, 12288)
        site = Site("flux", "fwd", pattern, "all_gather" if pattern == "ag_gemm" else "reduce_scatter",
                    4096 * 12288 * 2, *mkn)
        c = plan_site(site, hw, Collectives(hw), Group(8, 8), "pipelined", "symm_mem")
        label = f"Flux {'AG+GEMM' if pattern == 'ag_gemm' else 'GEMM+RS'} {hw_name.split('-')[0].upper()}"
        rows += [dict(what=f"{label}: GEMM", predicted=c.gemm_ms, measured=pub["gemm"]),
                 dict(what=f"{label}: NCCL", predicted=c.comm_ms, measured=pub["comm"]),
                 dict(what=f"{label}: sequential total", predicted=c.gemm_ms + c.comm_ms, measured=pub["total"]),
                 dict(what=f"{label}: overlapped (ours: pipelined x{c.chunks})", predicted=c.time_ms, measured=pub["flux"])]
    return rows


def async_tp_rows() -> list[dict]:
    hw, rows = preset("h100-sxm"), []
    for name, pub in ASYNC_TP.items():
        def run(tp_mode: str, transport: str):
            par = ParallelConfig(tp=8, dp=pub["dp"], global_batch=pub["dp"] * pub["batch"], recompute=pub["recompute"],
                                 zero=3, tp_transport=transport,
                                 overlap=Overlap(tp=tp_mode, dp="bulk", zero="pipelined"))
            return predict(load_model(name), par, hw)
        base, fast = run("none", "p2p"), run("auto", "symm_mem")
        rows.append(dict(what=f"async-TP {name} forward speed-up", predicted=base.layer_fwd.wall_ms / fast.layer_fwd.wall_ms,
                         measured=pub["fwd"]))
        rows.append(dict(what=f"async-TP {name} end-to-end speed-up", predicted=base.step_ms / fast.step_ms,
                         measured=pub["e2e"]))
    return rows


GPU_PRESETS = {"H200": "h200-sxm", "H100": "h100-sxm", "A100": "a100-sxm-80g"}


def _hardware_of(device: str):
    name = next((p for key, p in GPU_PRESETS.items() if key in device), None)
    return preset(name) if name else None


def tp_engine_rows(d: dict) -> list[dict]:
    """tp_overlap.py on CUDA: each GEMM alone; at world size 1 what chunking costs it, else the overlap."""
    hw = _hardware_of(d["device"])
    if hw is None:
        return []
    rows, world, m = [], d["world"], d["tokens"]
    for name, g in d["summary"]["gemms"].items():
        # K and N are the unsharded layer's; the GEMM timed is one rank's shard of it
        # (column layers split N, row layers split K over the tp ranks).
        k, n, tp = g["K"], g["N"], g["tp"]
        k, n = (k, n // tp) if g["kind"] == "ag" else (k // tp, n)
        measured = {key: r["ms"] for key, r in g["rows"].items() if r.get("ms") is not None}
        if "gemm" in measured:
            rows.append(dict(what=f"TP benchmark {name} (M={m}, K={k}, N={n}): GEMM", predicted=hw.gemm_ms(m, k, n),
                             measured=measured["gemm"]))
        pattern = "ag_gemm" if g["kind"] == "ag" else "gemm_rs"
        site = Site(name, "fwd", pattern, "all_gather" if g["kind"] == "ag" else "reduce_scatter",
                    m * (k if g["kind"] == "ag" else n) * 2, m, k, n)
        for key, ms in measured.items():
            if not key.startswith("pipelined "):
                continue
            transport, chunks = key.split()[1], int(key.split("c=")[1])
            if world == 1:  # nothing moves: the chunked GEMM alone
                pred = chunks * hw.gemm_ms(m // chunks, k, n)
            else:
                options = plan_site(site, hw, Collectives(hw), Group(world, world), "pipelined", transport).options
                pred = next((t for mode, c, t in options if mode == "pipelined" and c == chunks), float("nan"))
            rows.append(dict(what=f"TP benchmark {name}: {key}", predicted=pred, measured=ms))
        if world > 1 and "comm" in measured:
            c = plan_site(site, hw, Collectives(hw), Group(world, world), "none")
            rows.append(dict(what=f"TP benchmark {name}: collective", predicted=c.comm_ms, measured=measured["comm"]))
    return [r for r in rows if r["predicted"] == r["predicted"]]


def dp_engine_rows(r: dict) -> list[dict]:
    """dp_overlap.py on CUDA: the step without communication, and the gradient all-reduce."""
    hw = _hardware_of(r["device"])
    if hw is None:
        return []
    g = r["preset"]["gpt"]
    model = ModelConfig(hidden=g["hidden"], ffn_hidden=g["ffn_hidden"], num_layers=g["num_layers"], num_heads=g["num_heads"],
                        seq_len=g["seq_len"], vocab_size=g["vocab_size"], gated_mlp=False, name="dp-bench-gpt")
    # The benchmark's GPT is eager PyTorch under autocast: unfused memory-bound ops, and kernels short
    # enough that the host's dispatch sets the pace (this row is the host term's calibration point).
    par = ParallelConfig(dp=r["world"], micro_batch=r["preset"]["batch"], bucket_mib=r["preset"]["bucket_mb"],
                         overlap=Overlap(dp="bulk"), eager=True)
    p = predict(model, par, hw)
    rows = [dict(what=f"DP benchmark GPT, world {r['world']}: step without communication, ms "
                      f"(host term calibrated here: {hw.host_us_per_op:g} us per op)",
                 predicted=p.step_ms - p.exposed_ms, measured=r["rows"]["no communication"]["step_ms"])]
    comm = r["rows"]["overlapkit overlap=True"].get("comm_ms")
    if r["world"] > 1 and comm:
        rows.append(dict(what="DP benchmark: gradient all-reduce, ms", predicted=p.comm_ms, measured=comm))
    return rows


def engine_rows(results: Path) -> list[dict]:
    """The engines' own CUDA benchmark results in `results`, where they have run."""
    rows = []
    for path in sorted(p for p in results.glob("tp_overlap_*_ws*.json") if "_cpu_" not in p.name):
        d = json.loads(path.read_text())
        if "device" in d and "summary" in d:  # a benchmark's own output, not an A/B table built from several
            rows += tp_engine_rows(d)
    if (results / "dp_overlap_cuda.json").is_file():
        rows += dp_engine_rows(json.loads((results / "dp_overlap_cuda.json").read_text()))
    if (results / "lm_head_probe_cuda.json").is_file():
        rows += lm_head_rows(json.loads((results / "lm_head_probe_cuda.json").read_text()))
    return rows


def lm_head_rows(d: dict) -> list[dict]:
    """lm_head_probe.py on CUDA: the LM head GEMM and its fp32 cross-entropy, forward and backward."""
    hw = _hardware_of(d["device"])
    if hw is None:
        return []
    rows = []
    for r in d["rows"]:
        model = ModelConfig(hidden=r["hidden"], ffn_hidden=r["hidden"], num_layers=1, num_heads=1,
                            seq_len=r["tokens"], vocab_size=r["vocab"], gated_mlp=False)
        p = predict(model, ParallelConfig(sp=False), hw)
        shape = f"LM head {r['tokens']}x{r['hidden']}x{r['vocab']}"
        rows += [dict(what=f"{shape}: head + cross-entropy forward, ms", predicted=p.head_fwd.wall_ms, measured=r["fwd_ms"]),
                 dict(what=f"{shape}: forward + backward, ms", predicted=p.head_fwd.wall_ms + p.head_bwd.wall_ms,
                      measured=r["fwd_bwd_ms"])]
    return rows


def summary(rows: list[dict]) -> str:
    errs = [abs(err(r["predicted"], r["measured"])) for r in rows if r["measured"] == r["measured"]]
    if not errs:
        return ""
    p90 = sorted(errs)[int(0.9 * (len(errs) - 1))]
    return f"{len(errs)} rows: median |error| {statistics.median(errs):.1f}%, p90 {p90:.1f}%, max {max(errs):.1f}%"


def table(rows: list[dict], extra: str | None = None) -> str:
    head = "| what | predicted | measured | error % |" + (f" {extra} |" if extra else "")
    lines = [head, "|---|---:|---:|---:|" + ("---:|" if extra else "")]
    for r in rows:
        e = err(r["predicted"], r["measured"]) if r["measured"] == r["measured"] else float("nan")
        more = f" {err(r[extra], r['measured']):+.1f} |" if extra else ""
        measured = f"{r['measured']:.4g}" if e == e else "—"
        lines.append(f"| {r['what']} | {r['predicted']:.4g} | {measured} | {e:+.1f} |{more}".replace("+nan", "—"))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calibration", help="folder with h200_gemm_grid.json and h200_1gpu_probe.json")
    ap.add_argument("--out", default=None, help="results folder (default: benchmarks/results; with --smoke a new "
                                                "temporary folder)")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP + " (here: the whole table; it is quick)")
    ap.add_argument("--write-preset", action="store_true", help="refit src/overlapkit/costmodel/data/h200-sxm.json")
    ap.add_argument("--update-docs", action="store_true", help="rewrite the table block in docs/model.md")
    ap.add_argument("--ep-cp", action="store_true", help="instead: the context-parallel schedules and MoE chunking "
                    "priced against the committed 16-core runs (model_vs_cpu16.{json,md}; body in _lib/ep_cp_vs_measured.py)")
    args, rest = ap.parse_known_args(argv)
    if args.ep_cp:
        from _lib import ep_cp_vs_measured
        return ep_cp_vs_measured.main(rest + (["--out", args.out] if args.out else []))
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.smoke and (args.write_preset or args.update_docs):
        ap.error("--smoke writes nothing outside its results folder: not with --write-preset or --update-docs")
    cal = calibration_dir(args.calibration)
    if cal is None:
        print("no calibration folder (h200_gemm_grid.json) found; pass --calibration", file=sys.stderr)
        return 2
    grid = json.loads((cal / "h200_gemm_grid.json").read_text())
    probe = json.loads((cal / "h200_1gpu_probe.json").read_text())
    if args.write_preset:
        curves = fit_curves(with_add_probe(grid, add_probe()), 989.4, 132, source=PRESET_SOURCE)
        table_rows = ",\n".join("  " + json.dumps(p) for p in curves["gemm"].pop("table"))
        text = json.dumps(curves, indent=1)
        text = text.replace('"table_dtype": "bf16"', '"table_dtype": "bf16",\n  "table": [\n' + table_rows + "\n  ]")
        PRESET_JSON.write_text(text + "\n")
        print(f"wrote {PRESET_JSON}", file=sys.stderr)
        preset.cache_clear()
    out = Path(out_dir(args))
    chunk, small = probe_rows(probe)
    sections = [
        ("H200 GEMMs held out of the fit (all shapes of the M=2048 rows)", gemm_rows(grid), "roofline"),
        ("H200 chunked GEMMs: efficiency of x chunks of m/x rows (probe; not fitted)", chunk, None),
        ("H200 GEMMs with few rows (probe; not fitted)", small, None),
        ("H200 attention (TP=8 rows) and memory-bound ops (h != 8192; x + x, fitted at none, at every h), held out",
         attention_memory_rows(grid, add_probe()), None),
        ("Seeds' worked examples", worked_examples(), None),
        ("Flux, published (ms)", flux_rows(), None),
        ("PyTorch async-TP, published speed-ups (x)", async_tp_rows(), None),
        ("Engine benchmarks of this repository (CUDA runs)", engine_rows(out), None),
    ]
    md, docs = [], []
    for title, rows, extra in sections:
        head = f"### {title}\n\n{summary(rows) or 'not run yet: no results file'}\n"
        md += [head] + ([table(rows, extra) + "\n"] if rows else [])
        worst = sorted(rows, key=lambda r: -abs(err(r["predicted"], r["measured"])) if r["measured"] == r["measured"] else 0)
        shown = rows if len(rows) <= DOCS_ROWS else worst[:DOCS_ROWS]
        note = "" if len(rows) <= DOCS_ROWS else (f"The {DOCS_ROWS} largest errors; every row is in "
                                                  "benchmarks/results/model_vs_measured.md.\n\n")
        docs += [head] + ([note + table(shown, extra) + "\n"] if rows else [])
    text = "\n".join(md)
    out.mkdir(parents=True, exist_ok=True)
    (out / "model_vs_measured.md").write_text(text)
    (out / "model_vs_measured.json").write_text(json.dumps({t: rows for t, rows, _ in sections}, indent=1))
    print(text)
    if args.update_docs:
        docs_path = ROOT / "docs" / "model.md"
        body = docs_path.read_text()
        a, b = body.index(DOCS_BEGIN) + len(DOCS_BEGIN), body.index(DOCS_END)
        docs_path.write_text(body[:a] + "\n" + "\n".join(docs) + "\n" + body[b:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
