"""The Trainer's own step beside the hand-written loop: what the integration's glue costs.

The same HF Llama (a preset of _lib/hf_llama.py), `overlapkit.parallelize` (SP on, `--overlap`) and
overlapkit's DataParallel on the dp dim, AdamW, a linear schedule and max-norm clipping, trained:

- `hand`: the loop a user writes — slice this dp rank's batch, forward with `labels=`, backward,
  `clip_grad_norm_`, step, schedule, zero_grad;
- `trainer`: `overlapkit.integrations.OverlapTrainer` on the same data (accelerate's loader, split by
  dp), logging once at the end of each round, its overlap report off (`overlap_report_every=0`: the
  recorder's cost is one step per logging period, opt-in, and not the glue measured here).

Rounds alternate the two (hand first, then trainer, then hand, ...), each round `--steps` optimizer
steps after `--warmup` untimed ones. A step is timed on every rank from its start to its end (CUDA
synchronized at both ends, the same for both); a round's number is the median step of its slowest
rank; the ratio is the median over rounds of trainer/hand. Target: <= 1.02.

    python benchmarks/user_step.py --trainer --smoke
    python benchmarks/user_step.py --trainer --world 4 --tp 2 --dp 2 --preset cpu16 --threads 3 --warmup 5 --steps 20
    python benchmarks/user_step.py --trainer --device cuda --world 2 --tp 2 --dp 1 --preset 1b
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _lib

import torch  # noqa: E402

from _lib.common import add_common_args, device_label, out_dir, run_ranks, write_results  # noqa: E402
from _lib.hf_llama import PRESETS  # noqa: E402


def _stamp(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, ids):
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _model(cfg: dict, groups, overlap: str, device: torch.device):
    import overlapkit
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    sizes = {k: v for k, v in cfg.items() if k not in ("batch", "seq")}
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**sizes, max_position_embeddings=cfg["seq"]))
    if device.type == "cuda":
        model = model.to(torch.bfloat16)
    return overlapkit.parallelize(model, groups.mesh, overlap=overlap, sequence_parallel=True)


def _hand(cfg, groups, ids, overlap, steps, warmup, device) -> list[float]:
    from overlapkit.data_parallel import DataParallel
    from transformers import get_linear_schedule_with_warmup

    model = DataParallel(_model(cfg, groups, overlap, device), groups.dp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = get_linear_schedule_with_warmup(opt, 0, steps + warmup)
    b, dp, times = cfg["batch"], groups.sizes.dp, []
    for step in range(steps + warmup):
        start = _stamp(device)
        first = (step * dp + groups.dp_rank) * b
        batch = ids[first:first + b].to(device)
        model(input_ids=batch, labels=batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        model.zero_grad()
        if step >= warmup:
            times.append(_stamp(device) - start)
    return times


def _trainer(cfg, groups, ids, overlap, steps, warmup, device) -> list[float]:
    from overlapkit.integrations import OverlapTrainer
    from transformers import TrainerCallback, TrainingArguments

    class Clock(TrainerCallback):
        def __init__(self):
            self.times, self._start = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = _stamp(device)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step > warmup:
                self.times.append(_stamp(device) - self._start)

    clock = Clock()
    args = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="trainer_step_"), max_steps=steps + warmup,
                             per_device_train_batch_size=cfg["batch"], learning_rate=1e-4, max_grad_norm=1.0,
                             lr_scheduler_type="linear", optim="adamw_torch", logging_steps=steps + warmup,
                             save_strategy="no", report_to=[], train_sampling_strategy="sequential",
                             use_cpu=device.type == "cpu", bf16=device.type == "cuda", disable_tqdm=True)
    trainer = OverlapTrainer(model=_model(cfg, groups, overlap, device), args=args, groups=groups,
                             train_dataset=_Tokens(ids), callbacks=[clock], overlap_report_every=0)
    trainer.train()
    return clock.times


def _rank_body(cfg: dict, tp: int, dp: int, overlap: str, rounds: int, steps: int, warmup: int, threads: int,
               device_kind: str):
    import overlapkit
    import torch.distributed as dist

    torch.set_num_threads(threads)
    # accelerate sets torch's threads to physical cores / local ranks when OMP_NUM_THREADS is unset: both
    # variants must run on the same --threads.
    os.environ["OMP_NUM_THREADS"] = str(threads)
    groups = overlapkit.init(tp=tp, dp=dp)
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if device_kind == "cuda" else "cpu")
    n = (steps + warmup) * cfg["batch"] * dp
    ids = torch.randint(0, cfg["vocab_size"], (n, cfg["seq"]), generator=torch.Generator().manual_seed(1))
    out = {"hand": [], "trainer": []}
    for _ in range(rounds):
        for name, run in (("hand", _hand), ("trainer", _trainer)):
            times = torch.tensor(run(cfg, groups, ids, overlap, steps, warmup, device))
            dist.all_reduce(times, op=dist.ReduceOp.MAX)  # each step's slowest rank
            out[name].append(statistics.median(times.tolist()) * 1e3)
    return out


def _markdown(result: dict) -> str:
    a = result["args"]
    rows = [f"# Trainer step vs hand-written loop ({result['device']})", "",
            f"tp {a['tp']} x dp {a['dp']}, preset {a['preset']}, overlap {a['overlap']}, {a['rounds']} rounds of "
            f"{a['steps']} steps, {a['threads']} thread(s) a rank", "",
            "| variant | step ms (median over rounds) |", "|---|---:|"]
    rows += [f"| {k} | {statistics.median(v):.2f} |" for k, v in result["step_ms"].items()]
    rows += ["", f"trainer / hand: **{result['ratio']:.3f}x** (median of per-round ratios; target <= 1.02)", ""]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--overlap", default="auto")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    cfg = dict(PRESETS[args.preset])
    if args.smoke:
        cfg.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=64, batch=2, seq=16)
        args.rounds, args.steps, args.warmup = 1, 2, 1
    world = args.world or args.tp * args.dp
    if world != args.tp * args.dp:
        ap.error(f"--world {world} must be --tp x --dp = {args.tp * args.dp}")
    ranks = run_ranks(_rank_body, world, cfg, args.tp, args.dp, args.overlap, args.rounds, args.steps, args.warmup,
                      args.threads, args.device, device=args.device, timeout_s=3600)
    step_ms = ranks[0]
    ratios = [t / h for t, h in zip(step_ms["trainer"], step_ms["hand"])]
    result = {"args": vars(args), "device": device_label(args.device), "torch": torch.__version__,
              "step_ms": step_ms, "ratio": statistics.median(ratios), "ratios": ratios}
    write_results(result, os.path.join(out_dir(args), f"trainer_step_{args.device}_tp{args.tp}_dp{args.dp}"
                                       f"_{args.preset}"), _markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
