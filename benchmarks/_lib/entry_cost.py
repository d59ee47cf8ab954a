"""What the entry checks cost a step: a parallelized GPT's input check, and the data-parallel progress check.

Timed on `--world` ranks (gloo on CPU, NCCL on CUDA) with the GPT tensor-parallel over all of them:
- one training step (forward, vocabulary-parallel loss, backward, SGD) with the entry checks on
  (the model's input check and the loss's target check: one tiny all-gather each) and with both
  off, alternated in a balanced order (ms per step, median of the slowest rank);
- `check_inputs` alone on the step's ids (µs, median);
- DataParallel's progress check alone (counts only), and the parameter digest it adds every
  `DIGEST_EVERY` forwards (µs, median), for the same GPT's parameters on one rank.

    python benchmarks/reliability_cost.py --entry --smoke                           # seconds, 2 CPU ranks
    OVERLAPKIT_RANK_THREADS=4 python benchmarks/reliability_cost.py --entry --world 4   # the 16-core host, tp 4
    python benchmarks/reliability_cost.py --entry --device cuda --world 1 --hidden 4096 --layers 4 --seq 2048  # one GPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _lib

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _lib.common import (add_common_args, lm_train_step, out_dir, print_message, run_ranks,  # noqa: E402
                         time_variants, world_size, write_results)


def _median_us(fn, reps: int, device) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _rank(a: dict) -> dict:
    from _lib.unexported import Progress, check_inputs, vocab
    from overlapkit.models import GPT, GPTConfig, parallelize

    device = torch.device("cuda", torch.cuda.current_device()) if a["device"] == "cuda" else torch.device("cpu")
    cfg = GPTConfig(vocab_size=a["vocab"], seq_len=a["seq"], hidden=a["hidden"], num_heads=a["heads"],
                    ffn_hidden=4 * a["hidden"], num_layers=a["layers"])
    models, opts = {}, {}
    for name in ("checked", "unchecked"):
        torch.manual_seed(0)
        models[name] = parallelize(GPT(cfg).to(device), dist.group.WORLD, overlap="none")
        opts[name] = torch.optim.SGD(models[name].parameters(), lr=1e-3)
    for h in models["unchecked"].__dict__["_overlapkit_entry_guards"].values():
        h.remove()
    step = lm_train_step(models, opts, cfg.vocab_size, a["batch"], a["seq"], 0, device)
    real_check = vocab.check_inputs

    def run(name: str) -> None:
        vocab.check_inputs = real_check if name == "checked" else (lambda *_a, **_k: None)
        try:
            step(name)
        finally:
            vocab.check_inputs = real_check

    times = time_variants(run, ["checked", "unchecked"], a["steps"], a["warmup"], device)
    ids = torch.randint(0, cfg.vocab_size, (a["batch"], a["seq"]), device=device)
    check_us = _median_us(lambda: check_inputs(dist.group.WORLD, "bench", (ids,)), a["reps"], device)
    params = [p for p in models["unchecked"].parameters()]
    progress = Progress(params, dist.group.WORLD, "bench")
    progress.digest_every = 0
    progress_us = _median_us(lambda: progress.before_forward(True), a["reps"], device)
    digest_us = _median_us(progress._digest, a["reps"], device)
    return {"checked_ms": statistics.median(times["checked"]), "unchecked_ms": statistics.median(times["unchecked"]),
            "check_inputs_us": check_us, "progress_check_us": progress_us, "param_digest_us": digest_us,
            "parameters": len(params)}


def _markdown(r: dict) -> str:
    share = 100 * (r["checked_ms"] - r["unchecked_ms"]) / r["unchecked_ms"]
    return "\n".join([
        f"# Entry checks: {r['world']} {r['device']} ranks, GPT hidden {r['hidden']}, {r['layers']} layers, "
        f"batch {r['batch']} x seq {r['seq']}, vocab {r['vocab']}, tp {r['world']}",
        "",
        "| what | cost |", "|---|---:|",
        f"| training step, checks on (model inputs + loss targets) | {r['checked_ms']:.3f} ms |",
        f"| training step, checks off | {r['unchecked_ms']:.3f} ms |",
        f"| difference | {r['checked_ms'] - r['unchecked_ms']:+.3f} ms ({share:+.2f} %) |",
        f"| one `check_inputs` on the ids | {r['check_inputs_us']:.1f} µs |",
        f"| DataParallel progress check (counts) | {r['progress_check_us']:.1f} µs |",
        f"| parameter digest ({r['parameters']} parameters; every {r['digest_every']} forwards) | "
        f"{r['param_digest_us']:.1f} µs ({r['param_digest_us'] / r['digest_every']:.2f} µs a step) |",
        "", "Medians; steps of the slowest rank; the two step variants alternate in a balanced order.", ""])


def main(argv: list[str] | None = None) -> int:
    from _lib.unexported import DIGEST_EVERY

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args(argv)
    if args.smoke:
        args.hidden, args.heads, args.layers, args.seq, args.batch, args.vocab = 64, 4, 2, 32, 2, 256
        args.steps, args.warmup, args.reps = 6, 1, 20
    world = world_size(args)
    if world is None:
        return 1
    a = {k: getattr(args, k) for k in ("device", "hidden", "heads", "layers", "seq", "batch", "vocab", "steps",
                                        "warmup", "reps")}
    ranks = run_ranks(_rank, world, a, device=args.device, on_message=print_message)
    result = {**a, "world": world, "digest_every": DIGEST_EVERY,
              **{k: max(r[k] for r in ranks) for k in ranks[0] if k != "parameters"},
              "parameters": ranks[0]["parameters"], "per_rank": ranks}
    write_results(result, os.path.join(out_dir(args), f"entry_check_cost_{args.device}_ws{world}"), _markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
