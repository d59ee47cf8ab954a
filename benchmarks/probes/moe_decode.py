"""MoE decode at ep: one micro-batch against two (expert_parallel/two_batch.py), on CPU ranks over gloo.

A Qwen3-MoE-shaped transformers model from `overlapkit.parallelize` (experts over ep, attention over tp),
greedy `generate()` of `--new` tokens for `--batch` prompts of `--prompt` tokens on every rank, its MoE
blocks running each no-grad forward as one micro-batch (`inference_micro_batches(model, 1)`) or two (the
default). Per variant, in balanced order over the rounds, the slowest rank's median of: the prefill
forward (ms), the decode ms per token ((generate - prefill) / new tokens), and from the recorder, in one
more recorded generate, the mean exposed communication of a prefill and of a decode step
(`timeline.serving.recorded_steps`). The tokens of both variants are compared (they must be equal).

    python benchmarks/probes/moe_decode.py --smoke
    python benchmarks/probes/moe_decode.py --world 4 --ep 4 --threads 4 --batch 8 --prompt 128 --new 32
    python benchmarks/probes/moe_decode.py --world 4 --ep 2 --tp 2 --threads 4 --batch 8 --prompt 128 --new 32
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _lib
from _lib.common import add_out_arg, add_smoke_arg, line_up, out_dir, run_ranks, write_results  # noqa: E402

VARIANTS = ("one", "two")


def _config(args):
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "qwen3_moe", hidden_size=args.hidden, intermediate_size=2 * args.hidden, moe_intermediate_size=args.ffn,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8,
        vocab_size=1024, max_position_embeddings=args.prompt + args.new + 8, num_experts=args.experts,
        num_experts_per_tok=2, pad_token_id=1, bos_token_id=0, eos_token_id=2, attn_implementation="sdpa",
        output_router_logits=False)


def _rank(args) -> dict:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import overlapkit
    from _lib.unexported import by_kind, inference_micro_batches, recorded_steps
    from overlapkit.timeline import record

    torch.set_num_threads(args.threads)
    groups = overlapkit.init(ep=args.ep, tp=args.tp)
    torch.manual_seed(0)
    model = overlapkit.parallelize(AutoModelForCausalLM.from_config(_config(args)).float().eval(), groups.mesh)
    ids = torch.randint(3, 1024, (args.batch, args.prompt), generator=torch.Generator().manual_seed(groups.dp_rank))
    gen = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=1, synced_gpus=True)
    dev = torch.device("cpu")
    times = {v: {"prefill": [], "generate": []} for v in VARIANTS}
    tokens = {}
    for i in range(args.warmup + args.rounds):
        for v in (VARIANTS if i % 2 == 0 else VARIANTS[::-1]):
            inference_micro_batches(model, 1 if v == "one" else 2)
            line_up(dev)
            t0 = time.perf_counter()
            with torch.no_grad():
                model(input_ids=ids)
            t1 = time.perf_counter()
            line_up(dev)
            t2 = time.perf_counter()
            tokens[v] = model.generate(ids, **gen)
            t3 = time.perf_counter()
            if i >= args.warmup:
                times[v]["prefill"].append((t1 - t0) * 1e3)
                times[v]["generate"].append((t3 - t2) * 1e3)
    out = {"rank": dist.get_rank(), "equal_tokens": bool(torch.equal(tokens["one"], tokens["two"]))}
    for v in VARIANTS:
        inference_micro_batches(model, 1 if v == "one" else 2)
        line_up(dev)
        with record() as rec:
            model.generate(ids, **gen)
        rows = {r.kind: r for r in by_kind(dist.get_rank(), recorded_steps(rec.spans))}
        prefill, generate = statistics.median(times[v]["prefill"]), statistics.median(times[v]["generate"])
        out[v] = dict(prefill_ms=prefill, decode_ms_per_token=(generate - prefill) / args.new,
                      prefill_exposed_ms=rows["prefill"].exposed_ms if "prefill" in rows else None,
                      decode_exposed_ms=rows["decode"].exposed_ms if "decode" in rows else None,
                      decode_step_ms_recorded=rows["decode"].step_ms if "decode" in rows else None)
    return out


def _markdown(result: dict) -> str:
    a = result["args"]
    lines = [f"# MoE decode, one micro-batch vs two ({a['world']} CPU ranks x {a['threads']} threads, ep {a['ep']} "
             f"x tp {a['tp']}, batch {a['batch']} a rank, prompt {a['prompt']}, {a['new']} new tokens)", "",
             f"Qwen3-MoE shape: hidden {a['hidden']}, {a['layers']} layers, {a['experts']} experts of {a['ffn']}, "
             f"top-2. The slowest rank's median of {a['rounds']} rounds (after {a['warmup']}).", "",
             "| micro-batches | prefill ms | decode ms/token | prefill exposed ms | decode exposed ms/step |",
             "|---|---:|---:|---:|---:|"]
    for v in VARIANTS:
        r = result[v]

        def f(x):
            return "-" if x is None else f"{x:.2f}"
        lines.append(f"| {v} | {f(r['prefill_ms'])} | {f(r['decode_ms_per_token'])} | {f(r['prefill_exposed_ms'])} "
                     f"| {f(r['decode_exposed_ms'])} |")
    lines += ["", f"two / one: prefill {result['ratio']['prefill']:.3f}, decode {result['ratio']['decode']:.3f}; "
                  f"tokens equal on every rank: {result['equal_tokens']}", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--ep", type=int, default=None, help="default: the world size (over tp)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8, help="prompts per rank")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=768, help="each expert's width")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    add_out_arg(ap)
    add_smoke_arg(ap)
    args = ap.parse_args(argv)
    args.ep = args.ep or args.world // args.tp
    if args.smoke:
        args.batch, args.prompt, args.new, args.hidden, args.ffn, args.experts, args.layers = 4, 8, 3, 64, 32, 4, 2
        args.rounds, args.warmup = 1, 0
    results = run_ranks(_rank, args.world, args, timeout_s=1800)
    slowest = {v: {k: max((r[v][k] for r in results if r[v][k] is not None), default=None) for k in results[0][v]}
               for v in VARIANTS}
    result = dict(args=vars(args), **slowest, equal_tokens=all(r["equal_tokens"] for r in results), ranks=results,
                  ratio={"prefill": slowest["two"]["prefill_ms"] / slowest["one"]["prefill_ms"],
                         "decode": slowest["two"]["decode_ms_per_token"] / slowest["one"]["decode_ms_per_token"]})
    stem = os.path.join(out_dir(args), f"moe_decode_cpu_ws{args.world}_ep{args.ep}_tp{args.tp}")
    write_results(result, stem, _markdown)
    return 0 if result["equal_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
