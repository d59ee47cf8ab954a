"""Where a compiled step's host time goes: forward, backward, `clip_grad_norm_` and AdamW, per variant, side by side.

user_step.py's variants (HF Llama, `labels=`, clip, AdamW: foreach on CPU, fused on a GPU), each
`torch.compile`d whole (fullgraph), on a step small enough that the host is what the clock sees:
the median host milliseconds of each phase, steps interleaved variant by variant, and the graphs
dynamo compiled in the first two steps (a second step that compiles again is a recompile). At a
TP size of 1 a parallelized model whose parameters are DTensors pays in every phase (the graph's
edges, DTensor dispatch per clipping and optimizer op); with plain parameters it is the plain step.

    python benchmarks/probes/compiled_host_phases.py                        # CPU, one rank
    python benchmarks/probes/compiled_host_phases.py --world 2 --variants torch_tp_compiled,ok_none_compiled
    python benchmarks/probes/compiled_host_phases.py --smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _lib

import torch  # noqa: E402

from _lib.common import add_out_arg, add_smoke_arg, device_label, out_dir, run_ranks, write_results  # noqa: E402
from _lib.hf_llama import build_variant  # noqa: E402

PHASES = ("forward", "backward", "clip", "optimizer")


def _rank_body(cfg_kw: dict, variants: list[str], steps: int, device_type: str) -> dict:
    import overlapkit
    from torch._dynamo.utils import counters
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    world = torch.distributed.get_world_size()
    groups = overlapkit.init(tp=world, dp=1)
    kw = {k: v for k, v in cfg_kw.items() if k not in ("batch", "seq")}
    cfg = LlamaConfig(**kw, max_position_embeddings=cfg_kw["seq"], attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        base = LlamaForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (cfg_kw["batch"], cfg_kw["seq"]), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    fused = dict(fused=True) if device_type == "cuda" else dict(foreach=True)
    built = {}
    for name in variants:
        model, ctx = build_variant(name, base, groups, 1)
        built[name] = (model, ctx, torch.optim.AdamW(model.parameters(), lr=1e-4, **fused))

    def step(name: str) -> list[float]:
        model, ctx, opt = built[name]
        marks = [time.perf_counter()]
        with ctx():
            loss = model(input_ids=ids, labels=ids).loss
            marks.append(time.perf_counter())
            loss.backward()
        marks.append(time.perf_counter())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        marks.append(time.perf_counter())
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device_type == "cuda":
            torch.cuda.synchronize(device)
        marks.append(time.perf_counter())
        return [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]

    graphs, times = {}, {n: [] for n in variants}
    for name in variants:  # compiled in turn: each variant's graphs are the counter's growth over its two steps
        before = counters["stats"]["unique_graphs"]
        step(name)
        first = counters["stats"]["unique_graphs"]
        step(name)
        graphs[name] = (first - before, counters["stats"]["unique_graphs"] - first)
    for _ in range(steps):
        for name in variants:
            torch.distributed.barrier()
            times[name].append(step(name))
    return dict(graphs=graphs, ms={n: [statistics.median(t[i] for t in times[n]) for i in range(len(PHASES))]
                                   for n in variants})


def _markdown(result: dict) -> str:
    a = result["args"]
    head = (f"HF Llama (hidden {result['config']['hidden_size']}, {result['config']['num_hidden_layers']} layers, "
            f"{result['config']['batch']} x {result['config']['seq']} tokens), {result['device']}, world {a['world']}, "
            f"torch {result['torch']}, whole model torch.compile(fullgraph=True); host ms a phase, median of "
            f"{a['steps']} interleaved steps, slowest rank\n\n")
    rows = ["| variant | " + " | ".join(PHASES) + " | step | / first variant | graphs at step 1 | at step 2 |",
            "|---|" + "---:|" * (len(PHASES) + 4)]
    ref = sum(next(iter(result["ms"].values())))
    for n, ms in result["ms"].items():
        g1, g2 = result["graphs"][n]
        rows.append(f"| {n} | " + " | ".join(f"{v:.2f}" for v in ms) + f" | {sum(ms):.2f} | {sum(ms) / ref:.3f} | "
                    f"{g1} | {g2} |")
    return head + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--variants", default=None,
                    help="comma-separated user_step variants (default: plain_compiled,ok_none_compiled at world 1, "
                         "torch_tp_compiled,ok_none_compiled above)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    add_out_arg(ap)
    add_smoke_arg(ap)
    args = ap.parse_args(argv)
    if args.smoke:  # eager variants: the smoke run checks the script, not inductor's minutes on a shared CPU
        args.steps, args.variants = 2, args.variants or ("plain,ok_none" if args.world == 1 else "torch_tp,ok_none")
    variants = (args.variants or ("plain_compiled,ok_none_compiled" if args.world == 1 else
                                  "torch_tp_compiled,ok_none_compiled")).split(",")
    cfg = dict(hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
               num_attention_heads=4, num_key_value_heads=4, vocab_size=256, batch=1, seq=args.seq)
    per_rank = run_ranks(_rank_body, args.world, cfg, variants, args.steps, args.device, device=args.device)
    ms = {n: [max(r["ms"][n][i] for r in per_rank) for i in range(len(PHASES))] for n in variants}
    result = dict(device=device_label(args.device), torch=torch.__version__, args=vars(args), config=cfg, ms=ms,
                  graphs=per_rank[0]["graphs"])
    stem = os.path.join(out_dir(args), f"compiled_host_phases_{args.device}_ws{args.world}")
    write_results(result, stem, _markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
