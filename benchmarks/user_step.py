"""The benchmark of record: what a user runs — a Hugging Face causal LM trained the usual way — side by side.

Each variant trains the same HF model (built from a config, same seed, same batch) the way a
training loop does: forward with `labels=`, backward, `clip_grad_norm_`, AdamW step, zero_grad.
Side by side in one run, in a balanced order (every variant in every position of a round):

- `plain`: the model itself, unparallelized (one rank only: at more ranks it is not the same job);
- `torch_tp`: PyTorch's own TP+SP — `parallelize_module` with torch's ColwiseParallel /
  RowwiseParallel / SequenceParallel / PrepareModuleInput plan, written as torchtitan writes it for
  Llama (the sequence split at the first block, since HF builds its masks from the whole sequence),
  the loss under `loss_parallel()`; FSDP2 `fully_shard` on the dp dim when the mesh has one;
- `ok_<mode>`: `overlapkit.parallelize(model, mesh, overlap=mode)` with sequence parallelism (its
  default), for mode none / bulk / pipelined, and `ok_none_nosp` without it; `ok_auto` is the
  default, `overlapkit.parallelize(model, mesh)` with nothing passed (auto, SP on); overlapkit's
  `DataParallel` on the dp dim when the mesh has one;
- with `--set compiled`, the same variants, each whole model under `torch.compile(fullgraph=True)`
  (`--compile-mode reduce-overhead`: in CUDA graphs; the first step's seconds are the compile time),
  and on several GPUs torch's async-TP (its fused all-gather/reduce-scatter GEMMs). PyTorch TP's
  compiled model returns its loss alone (its DTensor logits, which no gradient reaches, fail a
  compiled backward: PyTorch #172556).

Reported per variant: step ms (slowest rank, median over rounds), the ratio to the reference
(plain at one rank, torch_tp otherwise: median of per-round ratios with its middle half), tokens/s,
peak memory per rank (the variant's parameters and optimizer state, plus what its step allocates
at most: the CUDA allocator's peak; on CPU, which keeps no allocator statistics, the tensors saved
for backward at the end of the forward), MFU on a GPU (the cost
model's FLOP count over the GPU's dense bf16 peak), the first step's seconds (compile time), and
the first step's loss, which must agree across variants (same init, same data).

    python benchmarks/user_step.py                                    # CPU, one rank, tiny config
    python benchmarks/user_step.py --world 4 --tp 4 --preset cpu16 --threads 3      # 16-core host
    python benchmarks/user_step.py --world 4 --tp 2 --dp 2 --preset cpu16 --threads 3
    python benchmarks/user_step.py --device cuda --world 1 --preset 1b              # one H200, bf16
    python benchmarks/user_step.py --device cuda --world 1 --preset 1b --set compiled
    python benchmarks/user_step.py --device cuda --world 1 --preset 1b --set compiled --compile-mode reduce-overhead
    python benchmarks/user_step.py --world 4 --tp 4 --preset cpu16 --threads 3 --set compiled  # inductor on CPU
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _lib.common import (adamw_options, add_out_arg, add_smoke_arg, balanced_orders, device_label, line_up,  # noqa: E402
                         out_dir, print_message, run_ranks, write_results)
from _lib.hf_llama import MODES, PRESETS, build_variant  # noqa: E402
from _lib.memory import held_peak_bytes, storages  # noqa: E402

def _state_bytes(model, opt) -> int:
    """This rank's bytes of parameters and optimizer state (local shards)."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t
    n = sum(local(p).numel() * local(p).element_size() for p in model.parameters())
    for state in opt.state.values():
        n += sum(local(v).numel() * local(v).element_size() for v in state.values() if isinstance(v, torch.Tensor))
    return n


def _step_peak_bytes(step, device: torch.device, exclude: set[int] = frozenset()) -> int:
    """The most one step allocates beyond what was allocated before it.

    CUDA: the allocator's peak. CPU has no allocator statistics (and a profiler with memory events
    costs seconds a step to read back at these sizes): there it is the most autograd holds for backward
    at once (`_lib.memory.held_peak_bytes`: storages counted once, those in `exclude` — the parameters and
    optimizer state `_state_bytes` already counts — left out), the activation memory in which TP
    implementations differ; transients inside an op are not seen.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    return held_peak_bytes(step, exclude)


def _rank_body(cfg_kw: dict, names: list[str], rounds: int, warmup: int, tp: int, dp: int, threads: int,
               device_type: str, clip: bool, budget_s: float | None, ep: int = 0,
               compile_mode: str = "default") -> dict:
    """One rank's timed steps; `ep` > 0: the MoE model with its experts over ep (_lib/hf_moe.py)."""
    import overlapkit
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(threads)
    device = torch.device(device_type, torch.cuda.current_device() if device_type == "cuda" else 0) \
        if device_type == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if device_type == "cuda" else torch.float32
    groups = overlapkit.init(tp=tp, dp=dp, ep=max(ep, 1))
    kw = {k: v for k, v in cfg_kw.items() if k not in ("batch", "seq")}
    if ep:
        from _lib.hf_moe import build_moe

        base = build_moe(cfg_kw, device, dtype)
        cfg = base.config
        whole_experts = sum(p.numel() * p.element_size() for n, p in base.named_parameters() if ".experts." in n)
    else:
        cfg = LlamaConfig(**kw, max_position_embeddings=cfg_kw["seq"], attn_implementation="sdpa")
        torch.manual_seed(0)
        with torch.device(device):
            base = LlamaForCausalLM(cfg).to(dtype)
    g = torch.Generator().manual_seed(1 + groups.coords.dp)  # each dp rank its own data, TP ranks the same
    ids = torch.randint(0, cfg.vocab_size, (cfg_kw["batch"], cfg_kw["seq"]), generator=g).to(device)

    if any(n.endswith("_compiled") for n in names):
        # Compile times compared fairly: inductor's one-time start-up paid before any variant, and
        # no variant served from the graph cache another one filled.
        torch._inductor.config.fx_graph_cache = False
        torch.compile(lambda t: t * 2)(torch.ones(2, device=device))
    models, opts, ctxs, first_s, loss0 = {}, {}, {}, {}, {}
    for name in names:
        if ep:
            from _lib.hf_moe import build_moe_variant

            models[name], ctxs[name] = build_moe_variant(name, base, groups), contextlib.nullcontext
        else:
            models[name], ctxs[name] = build_variant(name, base, groups, dp, compile_mode)
        opts[name] = torch.optim.AdamW(models[name].parameters(), lr=1e-4, **adamw_options(device_type))
    del base

    def step(name: str) -> float:
        model, opt = models[name], opts[name]
        if compile_mode == "reduce-overhead" and name.endswith("_compiled"):
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's graph outputs are no longer read
        with ctxs[name]():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        if ep:  # experts on several meshes: the dp average and the clip that know them
            from overlapkit.expert_parallel import average_data_parallel_grads, clip_grad_norm_

            average_data_parallel_grads(model, groups.dp, groups.ep)
            if clip:
                clip_grad_norm_(model.parameters(), 1.0)
        elif clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)

    from _lib.unexported import progress

    times = {n: [] for n in names}
    orders = balanced_orders(len(names))
    started = time.perf_counter()
    for i in range(warmup + rounds):
        if groups.rank == 0 and i:
            progress(f"round {i}: " + ", ".join(f"{n} {times[n][-1]:.0f} ms" for n in names if times[n]))
        if i >= warmup + 2 and budget_s:
            # Out of time: stop after whole rounds, every rank at the same one (rank 0's clock decides).
            late = torch.tensor([float(time.perf_counter() - started > budget_s)], device=device)
            dist.broadcast(late, 0)
            if late.item():
                break
        for name in (names[j] for j in orders[i % len(orders)]):
            line_up(device)
            t0 = time.perf_counter()
            loss = step(name)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            if name not in first_s:
                first_s[name], loss0[name] = dt, loss
            elif i >= warmup:
                times[name].append(dt * 1e3)
    peak = {}
    for name in names:  # after timing, so the profiler never runs beside a timed step
        line_up(device)
        state = [t for st in opts[name].state.values() for t in st.values()]
        peak[name] = _state_bytes(models[name], opts[name]) + _step_peak_bytes(
            lambda: step(name), device, storages(models[name].parameters(), state))
    out = dict(times=times, first_s=first_s, loss0=loss0, peak=peak)
    if ep:
        from _lib.common import EXPERT_EXCHANGES, comm_share
        from _lib.hf_moe import expert_bytes

        out["expert_bytes"] = {n: expert_bytes(models[n]) for n in names}
        out["all_to_all"] = {}
        for name in names:  # one profiled step each, after the timed ones
            line_up(device)
            out["all_to_all"][name] = comm_share(lambda: step(name), EXPERT_EXCHANGES)
        out["expert_bytes_whole"] = whole_experts
        out["chunks"] = {path: m.__dict__["_overlapkit_experts"][0].chunk_choice.decided
                         for n in names for path, m in models[n].named_modules() if "_overlapkit_experts" in m.__dict__}
    return out


def _variants(world: int, tp: int, which: str, device: str) -> list[str]:
    """The variants of a set: eager (the default), compiled, or both."""
    eager = (["plain"] if world == 1 else []) + ["torch_tp", *(f"ok_{m}" for m in MODES), "ok_none_nosp"]
    compiled = [n + "_compiled" for n in eager]
    if device == "cuda" and tp > 1:
        compiled.append("torch_async_tp_compiled")  # torch's fused AG+GEMM / GEMM+RS passes need NCCL and >= 2 GPUs
    return {"eager": eager, "compiled": compiled, "all": eager + compiled}[which]


def _summary(per_rank: list[dict], names: list[str], ref: str, tokens: int, flops: float | None,
             peak_tflops: float | None) -> dict:
    rounds = len(per_rank[0]["times"][names[0]])
    slowest = {n: [max(r["times"][n][i] for r in per_rank) for i in range(rounds)] for n in names}
    rows = {}
    for n in names:
        ms = statistics.median(slowest[n])
        ratios = sorted(slowest[n][i] / slowest[ref][i] for i in range(rounds))
        q = len(ratios) // 4
        rows[n] = dict(step_ms=ms, ratio=statistics.median(ratios), ratio_middle_half=[ratios[q], ratios[-1 - q]],
                       tokens_per_s=tokens / (ms / 1e3), peak_gib=max(r["peak"][n] for r in per_rank) / 2**30,
                       first_step_s=max(r["first_s"][n] for r in per_rank), loss0=per_rank[0]["loss0"][n],
                       mfu=(flops / (ms / 1e3) / len(per_rank) / (peak_tflops * 1e12)) if flops and peak_tflops else None)
    return rows


def _markdown(result: dict) -> str:
    a = result["args"]
    head = (f"HF Llama ({a['preset']}: hidden {result['config']['hidden_size']}, {result['config']['num_hidden_layers']} "
            f"layers, {a['batch']} x {a['seq']} tokens a dp rank), {result['device']}, tp={a['tp']} dp={a['dp']}, "
            f"{a['threads']} thread(s) a rank, torch {result['torch']}, transformers {result['transformers']}, "
            f"{a['rounds']} rounds after {a['warmup']}; ratio = median per-round ratio to `{result['reference']}` "
            "(middle half in brackets); step = slowest rank, median\n\n")
    rows = ["| variant | step ms | ratio | tokens/s | peak GiB/rank | MFU | first step s | loss0 |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for n, r in result["rows"].items():
        lo, hi = r["ratio_middle_half"]
        mfu = f"{100 * r['mfu']:.1f} %" if r["mfu"] is not None else "—"
        rows.append(f"| {n} | {r['step_ms']:.1f} | {r['ratio']:.3f} [{lo:.3f}, {hi:.3f}] | {r['tokens_per_s']:.0f} | "
                    f"{r['peak_gib']:.3f} | {mfu} | {r['first_step_s']:.2f} | {r['loss0']:.5f} |")
    notes = [f"\nfirst-step losses agree: {result['losses_agree']} (spread {result['loss_spread']:.2e})"]
    if result.get("best_fixed"):
        notes.append(f"auto / best fixed mode ({result['best_fixed']}): {result['auto_vs_best']:.3f}")
    return head + "\n".join(rows) + "\n" + "\n".join(notes) + "\n"


def _moe_main(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from transformers import __version__ as hf_version

    from _lib.hf_moe import MOE_PRESETS, MOE_VARIANTS, moe_markdown

    if args.smoke:  # the tiny MoE preset cut to one layer and 32 tokens, one round after one
        args.preset, args.layers, args.batch, args.seq, args.rounds, args.warmup = "tiny", 1, 1, 32, 1, 1
    else:  # chunks="auto" times its candidates on each layer's first 20 calls: measure what it kept
        args.warmup = max(args.warmup, 21)
    tp = args.tp or 1
    dp = args.world // tp
    if tp * dp != args.world or dp % args.ep:
        ap.error(f"--moe: --tp {tp} must divide --world {args.world} and --ep {args.ep} the rest ({dp})")
    if args.preset not in MOE_PRESETS:
        ap.error(f"--moe: --preset must be one of {sorted(MOE_PRESETS)}")
    cfg = dict(MOE_PRESETS[args.preset])
    for k, key in (("batch", "batch"), ("seq", "seq"), ("layers", "num_hidden_layers")):
        if getattr(args, k) is not None:
            cfg[key] = getattr(args, k)
    names = [n for n in MOE_VARIANTS if not args.variants or n in args.variants.split(",")]
    rounds = args.rounds or (8 if args.device == "cuda" else 6)
    per_rank = run_ranks(_rank_body, args.world, cfg, names, rounds, args.warmup, tp, dp, args.threads,
                         args.device, args.clip, args.budget_s, args.ep, device=args.device, timeout_s=args.timeout,
                         on_message=print_message)
    ref = "torch_ep" if "torch_ep" in names else names[0]
    rows = _summary(per_rank, names, ref, cfg["batch"] * cfg["seq"] * dp, None, None)
    losses = [r["loss0"] for r in rows.values()]
    spread = (max(losses) - min(losses)) / abs(statistics.median(losses))
    result = dict(device=device_label(args.device), torch=torch.__version__, transformers=hf_version,
                  args=dict(vars(args), tp=tp, dp=dp, rounds=len(per_rank[0]["times"][names[0]]), batch=cfg["batch"],
                            seq=cfg["seq"]),
                  config=cfg, reference=ref, rows=rows, loss_spread=spread,
                  losses_agree=spread <= (2e-2 if args.device == "cuda" else 1e-4),
                  expert_mib={n: max(r["expert_bytes"][n] for r in per_rank) / 2**20 for n in names},
                  expert_mib_whole=per_rank[0]["expert_bytes_whole"] / 2**20, ok_ep_chunks=per_rank[0]["chunks"],
                  all_to_all={n: max((r["all_to_all"][n] for r in per_rank), key=lambda x: x[0]) for n in names})
    if any(abs(result["expert_mib"][n] * args.ep - result["expert_mib_whole"]) > 1e-6 for n in names):
        raise AssertionError(f"expert memory per rank is not 1/ep of the experts: {result['expert_mib']}")
    stem = os.path.join(out_dir(args), f"user_step_moe_{args.device}_{args.preset}_ws{args.world}_ep{args.ep}_tp{tp}")
    write_results(result, stem, moe_markdown)
    return 0 if result["losses_agree"] else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # The user's path in its other shapes, each a script of its own under _lib: a transformers causal LM in
    # pipeline stages beside torch.distributed.pipelining (--pp), and the Trainer's step beside the hand loop (--trainer).
    for flag, module in (("--pp", "_lib.user_pp"), ("--trainer", "_lib.user_trainer")):
        if flag in argv:
            import importlib
            return importlib.import_module(module).main([a for a in argv if a != flag])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: the world)")
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 8 on a GPU, 6 on CPU)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads a rank")
    ap.add_argument("--set", dest="which", choices=("eager", "compiled", "all"), default="eager",
                    help="which variants: eager, torch.compile'd (compile time reported), or both")
    ap.add_argument("--compile-mode", default="default",
                    choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
                    help="torch.compile's mode for the compiled variants (reduce-overhead: CUDA graphs)")
    ap.add_argument("--no-clip", dest="clip", action="store_false", help="skip clip_grad_norm_")
    ap.add_argument("--variants", default=None, help="comma-separated subset of the variants")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop timing after the round that passes this many seconds (at least 2 rounds)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--moe", action="store_true", help="the MoE model (Qwen3-MoE shape) with its experts over --ep, "
                    "overlapkit's routing beside torchtitan's (_lib/hf_moe.py)")
    ap.add_argument("--ep", type=int, default=2, help="with --moe: expert-parallel size (divides world / tp)")
    add_out_arg(ap)
    add_smoke_arg(ap)
    args = ap.parse_args(argv)
    if args.moe:
        return _moe_main(ap, args)
    if args.smoke:  # the tiny preset cut to one layer and 32 tokens, one round after one
        args.preset, args.layers, args.batch, args.seq, args.rounds, args.warmup = "tiny", 1, 1, 32, 1, 1
    tp = args.tp or args.world // args.dp
    if tp * args.dp != args.world:
        ap.error(f"--tp {tp} x --dp {args.dp} is not the world {args.world}")
    cfg = dict(PRESETS[args.preset])
    for k, key in (("batch", "batch"), ("seq", "seq"), ("layers", "num_hidden_layers")):
        if getattr(args, k) is not None:
            cfg[key] = getattr(args, k)
    names = _variants(args.world, tp, args.which, args.device)
    if args.variants:
        wanted = args.variants.split(",")
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            ap.error(f"--variants: unknown {unknown}; known {names}")
        names = [n for n in names if n in wanted]
    rounds = args.rounds or (8 if args.device == "cuda" else 6)
    per_rank = run_ranks(_rank_body, args.world, cfg, names, rounds, args.warmup, tp, args.dp, args.threads,
                         args.device, args.clip, args.budget_s, 0, args.compile_mode, device=args.device,
                         timeout_s=args.timeout, on_message=print_message)
    from transformers import __version__ as hf_version

    from _lib.unexported import from_hf_config, step_flops

    model_cfg = from_hf_config({k: v for k, v in cfg.items() if k not in ("batch", "seq")} | {"hidden_act": "silu"},
                               seq_len=cfg["seq"])
    flops = step_flops(model_cfg, cfg["batch"] * args.dp, "megatron2024")
    peak_tflops = None
    if args.device == "cuda" and "H200" in device_label("cuda"):
        from overlapkit.costmodel import load_hardware
        peak_tflops = load_hardware("h200-sxm").bf16_tflops
    ref = next(n for n in ("plain", "plain_compiled", "torch_tp", "torch_tp_compiled") if n in names)
    rows = _summary(per_rank, names, ref, cfg["batch"] * cfg["seq"] * args.dp, flops, peak_tflops)
    losses = [r["loss0"] for r in rows.values()]
    spread = (max(losses) - min(losses)) / abs(statistics.median(losses))
    result = dict(device=device_label(args.device), torch=torch.__version__, transformers=hf_version,
                  args=dict(vars(args), tp=tp, rounds=len(per_rank[0]["times"][names[0]]), batch=cfg["batch"],
                            seq=cfg["seq"]),
                  config=cfg, reference=ref, rows=rows, loss_spread=spread,
                  losses_agree=spread <= (2e-2 if args.device == "cuda" else 1e-4))
    suffix = "_compiled" if args.which == "compiled" else ""
    fixed = {m: rows[f"ok_{m}{suffix}"]["step_ms"] for m in ("none", "bulk", "pipelined") if f"ok_{m}{suffix}" in rows}
    if fixed and f"ok_auto{suffix}" in rows:
        best = min(fixed, key=fixed.get)
        result.update(best_fixed=best, auto_vs_best=rows[f"ok_auto{suffix}"]["step_ms"] / fixed[best])
    layout = f"tp{tp}" + (f"_dp{args.dp}" if args.dp > 1 else "")
    mode = "" if args.compile_mode == "default" else "_" + args.compile_mode.replace("-", "_")
    stem = os.path.join(out_dir(args), f"user_step_{args.device}_{args.preset}_ws{args.world}_{layout}_{args.which}{mode}")
    write_results(result, stem, _markdown)
    return 0 if result["losses_agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
