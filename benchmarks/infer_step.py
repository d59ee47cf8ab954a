"""Serving, side by side: prefill tokens/s and decode ms/token of HF's own `generate()` on one Llama, per variant.

Every variant runs `model.generate(ids, max_new_tokens=N, min_new_tokens=N)` (greedy, HF's KV cache) on
the same prompts; a stopping criterion stamps every step (after a device synchronize, which generate
itself does each step), so one call gives the prefill (start to the first token) and the decode steps
(first token to last, per token). Side by side in one run, in a balanced order per batch size:

- `plain`: the model itself (world size 1 only: at more ranks it is not the same job);
- `torch_tp`: PyTorch's own TP through DTensor: the model's own transformers `tp_plan` (colwise / rowwise,
  the head colwise gathering its output) applied by `parallelize_module` with torch's styles;
- `ok`: `overlapkit.parallelize(model, mesh)` with nothing passed: the prompt prefilled sequence parallel
  through the pipelined all-gather+GEMM / GEMM+reduce-scatter (auto), the generated tokens in the decode
  layout (each row layer's all-reduce fused with the residual add and the next norm);
- `ok_nosp`: the same with `sequence_parallel=False`: the prefill in the decode layout too.
- `ok_2mb` (tp > 1): `parallelize(..., inference=InferenceConfig(prefill="two_batch"))`: the prefill in the
  decode layout with the batch cut in two, one half's all-reduce in flight under the other half's GEMMs.
- `ok_graphs` (CUDA only): `ok` with its decode steps replayed from CUDA graphs (static KV cache).

Also per variant, counted once (untimed) from a profiler's ops: the collectives one decode step issues
(c10d and functional, the entry check's included), and from one profiled prefill the share of its time a
transfer was in flight (the union of the collectives' ranges): for `torch_tp`, whose collectives are waited at
once, the most that hiding every one could save of its prefill. The prompt's tokens must agree across variants
(they are compared; fp32 on CPU).

    python benchmarks/infer_step.py                                         # CPU, one rank, tiny
    python benchmarks/infer_step.py --world 4 --preset cpu16 --threads 4 --batch 8     # 16-core host, tp 4
    python benchmarks/infer_step.py --device cuda --world 1 --preset 1b               # one GPU: the fixed cost
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from _lib.common import (add_out_arg, add_smoke_arg, balanced_orders, device_label, line_up, out_dir,  # noqa: E402
                         print_message, run_ranks, write_results)
from _lib.hf_llama import PRESETS  # noqa: E402

PROMPTS = {"tiny": 128, "cpu16": 512, "1b": 2048}
"""Default prompt length per preset (the GPU's within the issue's 512-4096; the CPU presets' smaller)."""


def torch_tp_plan_from_hf(model) -> dict:
    """The model's own transformers tp_plan as torch's DTensor styles (what HF's tp_plan="auto" means)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
              "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
              "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate())}
    prefix = model.base_model_prefix
    plan = {f"{prefix}.{k}": styles[v]() for k, v in model.config.base_model_tp_plan.items()}
    plan.update({k: styles[v]() for k, v in (type(model)._tp_plan or {}).items()})
    return plan


def _build(name: str, base, groups, device):
    """(the variant's model, its StepGraphs or None)."""
    import copy

    import overlapkit
    from torch.distributed.tensor.parallel import parallelize_module

    model = copy.deepcopy(base)
    if name == "torch_tp":
        parallelize_module(model, groups.mesh["tp"], torch_tp_plan_from_hf(model))
    elif name in ("ok", "ok_graphs"):
        overlapkit.parallelize(model, groups.mesh)
    elif name == "ok_nosp":
        overlapkit.parallelize(model, groups.mesh, sequence_parallel=False)
    elif name == "ok_2mb":
        from overlapkit.inference import InferenceConfig

        overlapkit.parallelize(model, groups.mesh, inference=InferenceConfig(prefill="two_batch"))
    graphs = None
    if name == "ok_graphs":
        from overlapkit.models import capture_decode_graphs

        graphs = capture_decode_graphs(model)
    return model.eval(), graphs


class _Stamps:
    """A stopping criterion that never stops and stamps the end of every generate step."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.t = device, []

    def __call__(self, input_ids, scores, **kwargs):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.t.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _generate(model, ids, new: int, device, static: bool):
    from transformers import StoppingCriteriaList

    stamps = _Stamps(device)
    kw = dict(cache_implementation="static", disable_compile=True) if static else {}
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0, stopping_criteria=StoppingCriteriaList([stamps]), **kw)
    return (stamps.t[0] - t0) * 1e3, (stamps.t[-1] - stamps.t[0]) * 1e3 / max(1, len(stamps.t) - 1), out


def _decode_collectives(model, ids) -> int:
    """Collectives one decode step issues (after a prefill into HF's dynamic cache): the c10d and functional
    collective ops a profiler sees (waits not counted)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
    def collective(e) -> bool:
        return e.name.split("::")[0] in ("c10d", "_c10d_functional") and not any(w in e.name for w in ("wait", "wrap"))

    def outermost(e) -> bool:  # a functional collective calls the c10d one: count it once
        parent = e.cpu_parent
        while parent is not None:
            if collective(parent):
                return False
            parent = parent.cpu_parent
        return True

    return sum(1 for e in prof.events() if collective(e) and outermost(e))


def _rank_body(cfg_kw: dict, names: list[str], batches: list[int], prompt: int, new: int, rounds: int, warmup: int,
               threads: int, device_type: str) -> dict:
    import torch.distributed as dist

    import overlapkit
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(threads)
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if device_type == "cuda" else torch.float32
    groups = overlapkit.init(tp=dist.get_world_size())
    kw = {k: v for k, v in cfg_kw.items() if k not in ("batch", "seq")}
    cfg = LlamaConfig(**kw, max_position_embeddings=prompt + new, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        base = LlamaForCausalLM(cfg).to(dtype).eval()
    built = {n: _build(n, base, groups, device) for n in names}
    models = {n: m for n, (m, _) in built.items()}
    del base
    from _lib.unexported import progress

    out = dict(prefill={}, decode={}, agree={}, collectives={})
    prompts = {b: torch.randint(3, cfg.vocab_size, (b, prompt), generator=torch.Generator().manual_seed(b)).to(device)
               for b in batches}
    for batch, ids in prompts.items():
        pre, dec, seqs = {n: [] for n in names}, {n: [] for n in names}, {}
        orders = balanced_orders(len(names))
        for i in range(warmup + rounds):
            for name in (names[j] for j in orders[i % len(orders)]):
                line_up(device)
                p_ms, d_ms, seq = _generate(models[name], ids, new, device, name == "ok_graphs")
                seqs.setdefault(name, seq)
                if i >= warmup:
                    pre[name].append(p_ms)
                    dec[name].append(d_ms)
            if groups.rank == 0:
                progress(f"batch {batch} round {i}: " + ", ".join(f"{n} {dec[n][-1]:.1f} ms/token" for n in names
                                                                  if dec[n]))
        out["prefill"][batch], out["decode"][batch] = pre, dec
        first = seqs[names[0]]
        out["agree"][batch] = {n: torch.equal(seqs[n], first) for n in names}
    from _lib.common import COLLECTIVES, comm_share

    for batch, ids in prompts.items():  # one profiled prefill a variant, after the timed ones
        for name in names:
            line_up(device)
            with torch.no_grad():
                out.setdefault("prefill_comm", {}).setdefault(batch, {})[name] = comm_share(
                    lambda: models[name](input_ids=ids), COLLECTIVES)
    small = torch.randint(3, cfg.vocab_size, (batches[0], 8), generator=torch.Generator().manual_seed(7)).to(device)
    out["collectives"] = {n: _decode_collectives(models[n], small) for n in names if n != "ok_graphs"}
    out["graphs"] = {n: dict(replays=g.replays, refused=sorted(set(g.refused.values())))
                     for n, (_, g) in built.items() if g is not None}
    return out


def _summary(per_rank: list[dict], names: list[str], batches: list[int], ref: str, prompt: int) -> dict:
    rows = {}
    for batch in batches:
        rounds = len(per_rank[0]["decode"][batch][names[0]])
        slow = {k: {n: [max(r[k][batch][n][i] for r in per_rank) for i in range(rounds)] for n in names}
                for k in ("prefill", "decode")}
        for n in names:
            ratio = {k: statistics.median(a / b for a, b in zip(slow[k][n], slow[k][ref])) for k in slow}
            pre = statistics.median(slow["prefill"][n])
            rows[f"{batch}/{n}"] = dict(batch=batch, variant=n, prefill_ms=pre, prefill_tokens_per_s=batch * prompt / pre * 1e3,
                                        decode_ms_per_token=statistics.median(slow["decode"][n]),
                                        prefill_ratio=ratio["prefill"], decode_ratio=ratio["decode"],
                                        tokens_agree=all(r["agree"][batch][n] for r in per_rank),
                                        prefill_comm_share=max(c / t for t, c in (r["prefill_comm"][batch][n]
                                                                                  for r in per_rank)),
                                        decode_collectives=per_rank[0]["collectives"].get(n))
    return rows


def _markdown(result: dict) -> str:
    a = result["args"]
    head = (f"HF Llama ({a['preset']}: hidden {result['config']['hidden_size']}, {result['config']['num_hidden_layers']} "
            f"layers), `generate()` greedy, prompt {a['prompt']} tokens, {a['new']} new tokens, {result['device']}, "
            f"tp={a['world']}, {a['threads']} thread(s) a rank, torch {result['torch']}, transformers "
            f"{result['transformers']}, {a['rounds']} rounds after {a['warmup']}; slowest rank, median; ratio = median "
            f"per-round ratio to `{result['reference']}`\n\n")
    lines = ["| batch | variant | prefill ms | prefill tokens/s | prefill ratio | decode ms/token | decode ratio | "
             "collectives / decode step | prefill comm share | tokens agree |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"].values():
        lines.append(f"| {r['batch']} | {r['variant']} | {r['prefill_ms']:.1f} | {r['prefill_tokens_per_s']:.0f} | "
                     f"{r['prefill_ratio']:.3f} | {r['decode_ms_per_token']:.2f} | {r['decode_ratio']:.3f} | "
                     f"{r['decode_collectives'] if r['decode_collectives'] is not None else '—'} | "
                     f"{r['prefill_comm_share']:.1%} | {r['tokens_agree']} |")
    notes = ["\nprefill comm share: of one profiled prefill (the slowest rank's share), the union of the collectives' "
             "ranges: for torch_tp the most hiding them could save; for the overlapped variants their time in flight."]
    notes += [f"\n{n}: {g['replays']} decode steps replayed from CUDA graphs" +
             (f"; captures refused: {g['refused']}" if g["refused"] else "") for n, g in result["graphs"].items()]
    return head + "\n".join(lines) + "\n" + "\n".join(notes) + ("\n" if notes else "")


def _variants(world: int, device: str) -> list[str]:
    return (["plain"] if world == 1 else []) + ["torch_tp", "ok", "ok_nosp"] + (["ok_2mb"] if world > 1 else []) + \
        (["ok_graphs"] if device == "cuda" else [])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--world", type=int, default=1, help="ranks = the tensor-parallel size")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--batch", default=None, help="comma-separated batch sizes (default 1,8,32 on a GPU, 1,8 on CPU)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default: per preset, see PROMPTS)")
    ap.add_argument("--new", type=int, default=None, help="new tokens (default 128 on a GPU, 32 on CPU)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per batch (default 6 on a GPU, 3 on CPU)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads a rank")
    ap.add_argument("--variants", default=None, help="comma-separated subset of the variants")
    ap.add_argument("--timeout", type=float, default=600.0)
    add_out_arg(ap)
    add_smoke_arg(ap)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is visible", file=sys.stderr)
        return 2
    gpu = args.device == "cuda"
    if args.smoke:  # the tiny preset cut to one layer, 16-token prompts, 4 new tokens, one round after one
        args.preset, args.layers, args.batch, args.prompt, args.new, args.rounds, args.warmup = \
            "tiny", 1, "2", 16, 4, 1, 1
    batches = [int(b) for b in (args.batch or ("1,8,32" if gpu else "1,8")).split(",")]
    args.prompt = args.prompt or PROMPTS[args.preset]
    args.new = args.new or (128 if gpu else 32)
    args.rounds = args.rounds or (6 if gpu else 3)
    if args.prompt % args.world:
        ap.error(f"--prompt {args.prompt} must split over --world {args.world} (the prefill is sequence parallel)")
    cfg = dict(PRESETS[args.preset])
    if args.layers is not None:
        cfg["num_hidden_layers"] = args.layers
    names = _variants(args.world, args.device)
    if args.variants:
        unknown = sorted(set(args.variants.split(",")) - set(names))
        if unknown:
            ap.error(f"--variants: unknown {unknown}; known {names}")
        names = [n for n in names if n in args.variants.split(",")]
    per_rank = run_ranks(_rank_body, args.world, cfg, names, batches, args.prompt, args.new, args.rounds, args.warmup,
                         args.threads, args.device, device=args.device, timeout_s=args.timeout,
                         on_message=print_message)
    from transformers import __version__ as hf_version

    ref = next(n for n in ("plain", "torch_tp", *names) if n in names)
    result = dict(device=device_label(args.device), torch=torch.__version__, transformers=hf_version,
                  args=dict(vars(args), batches=batches), config=cfg, reference=ref,
                  rows=_summary(per_rank, names, batches, ref, args.prompt), graphs=per_rank[0]["graphs"])
    stem = os.path.join(out_dir(args), f"infer_step_{args.device}_{args.preset}_ws{args.world}")
    write_results(result, stem, _markdown)
    return 0 if all(r["tokens_agree"] for r in result["rows"].values()) or gpu else 1


if __name__ == "__main__":
    sys.exit(main())
