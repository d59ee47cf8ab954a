"""A Hugging Face Llama in pipeline stages, side by side in one run: `overlapkit.pipeline()` (its cut from
the config's base_model_pp_plan, the model's own labels= loss) under each schedule, and
torch.distributed.pipelining's schedule of the same name driving the very same chunks; each step a user's
(the schedule's forward, loss and backward, then clipping by the whole model's norm and AdamW).

Variants take turns step by step in a balanced order (each in every position of a round), so load
that comes and goes hits them alike; a step's time is the slowest rank's, the table gives the median,
the ratio is the median of per-round ratios (with its middle half). Target: overlapkit's step <= 0.97x
torch's schedule of the same name. Every variant's first loss must agree (same model, same batch).

    python benchmarks/user_step.py --pp --smoke                                    # seconds, measures nothing
    python benchmarks/user_step.py --pp --world 4 --threads 4 --preset cpu16       # the 16-core host, pp 4

Writes benchmarks/results/hf_pipeline_cpu_ws<N>.json and .md.
"""

from __future__ import annotations

import copy
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _lib

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _lib.common import device_label, out_dir, pipeline_args, run_ranks, time_variants, write_results  # noqa: E402
from _lib.memory import held_peak_bytes, storages  # noqa: E402
from _lib.ratios import per_round, text, verdict  # noqa: E402

TORCH = {"1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
         "zb1p": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
"""torch's schedule of the same name as each of ours (ScheduleInterleavedZeroBubble at one stage a rank is ZB-H1)."""
TARGET = 0.97
V_SHAPED = ("zbv", "dualpipev")
"""Schedules whose two stages a rank holds meet on that rank (torch sends between them)."""
PRESETS = {
    # two layers a stage at v=1, one at v=2; ~0.3 TFLOP a step (8 micro-batches of 256 tokens), about a second at pp 4
    # on 16 cores. (Hidden 1024, vocab 32000, 512 tokens was ~3 TFLOP a step: no variant finished its 23 steps in
    # 320 s on the H100 host.)
    "cpu16": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=8192, seq=256, rows=1),
    "smoke": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, seq=32, rows=1),
}


def _rank_body(preset: dict, schedules: list[str], m: int, steps: int, warmup: int, threads: int) -> dict:
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining import PipelineStage
    from transformers import LlamaConfig, LlamaForCausalLM

    import overlapkit
    from overlapkit import pipeline
    from overlapkit.pipeline_parallel import chunks_of, placement

    torch.set_num_threads(threads)
    groups = overlapkit.init(pp=dist.get_world_size())
    pp, rank = groups.sizes.pp, groups.pp_rank
    kw = {k: v for k, v in preset.items() if k not in ("seq", "rows")}
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**kw, max_position_embeddings=preset["seq"], attn_implementation="sdpa"))
    ids = torch.randint(0, kw["vocab_size"], (m * preset["rows"], preset["seq"]),
                        generator=torch.Generator().manual_seed(1))
    runs, first_loss, chunks_of_variant = {}, {}, {}
    for schedule in schedules:
        cls = getattr(pipelining, TORCH[schedule], None)
        ours = pipeline(copy.deepcopy(base), groups, schedule=schedule, microbatches=m)
        runs[f"overlapkit {schedule}"] = lambda p=ours: p.step(ids, ids)
        chunks_of_variant[f"overlapkit {schedule}"] = ours.chunks
        if cls is None:
            continue
        if schedule in V_SHAPED and tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 13):
            # torch 2.11's V schedules send the stage that stays on this rank to the rank itself over gloo:
            # 'Pair is not connected ([...] <--> [none])' on the last rank, its peers then wait forever
            if rank == 0:
                print(f"torch {TORCH[schedule]} left out: torch {torch.__version__.split('+')[0]}'s V schedules "
                      "send to their own rank over gloo", file=sys.stderr, flush=True)
            continue
        theirs = pipeline(copy.deepcopy(base), groups, schedule=schedule, microbatches=m, check=False)
        v = theirs.engine.config.virtual_stages
        stages = [PipelineStage(c, k, pp * v, torch.device("cpu"), group=groups.pp)
                  for k, c in zip(chunks_of(rank, pp, v, placement(schedule)), theirs.chunks)]
        lm_loss, vocab = theirs.loss_function, kw["vocab_size"]
        sched = cls(stages[0] if schedule == "1f1b" else stages, m,
                    loss_fn=lambda logits, labels, f=lm_loss: f(logits=logits, labels=labels, vocab_size=vocab))
        last = any(c.last for c in theirs.chunks)

        def run(sched=sched, theirs=theirs, last=last):
            theirs.shape.seq_len = ids.shape[1]
            losses = []
            sched.step(*([ids] if rank == 0 else []), **(dict(target=ids, losses=losses) if last else {}))
            out = torch.stack(losses).mean() if last else torch.zeros(())
            dist.all_reduce(out, group=groups.pp)  # the loss on every rank, as ours returns it
            return out
        runs[f"torch {TORCH[schedule]}"] = run
        chunks_of_variant[f"torch {TORCH[schedule]}"] = theirs.chunks

    from overlapkit.expert_parallel import clip_grad_norm_

    opts = {n: torch.optim.AdamW([p for c in cs for p in c.parameters()], lr=1e-4, foreach=True)
            for n, cs in chunks_of_variant.items()}

    def step(name: str) -> None:  # a user's step: zero_grad, the schedule (forward, loss, backward), clip, AdamW
        for c in chunks_of_variant[name]:
            c.zero_grad(set_to_none=False)
        loss = runs[name]()
        first_loss.setdefault(name, float(loss))
        # every stage clips by the whole model's norm (torch's clip on a stage's parameters would use the stage's)
        clip_grad_norm_(opts[name].param_groups[0]["params"], 1.0, group=groups.pp)
        opts[name].step()

    names = list(runs)
    times = time_variants(step, names, steps, warmup, torch.device("cpu"))
    peak = {}
    for name in names:  # after the timed steps: the parameters, their gradients and the activations held at once
        params = [p for c in chunks_of_variant[name] for p in c.parameters()]
        state = sum(p.numel() * p.element_size() * (2 if p.grad is not None else 1) for p in params)
        peak[name] = state + held_peak_bytes(lambda n=name: step(n), storages(params))
    return dict(times=times, first_loss=first_loss, tokens=ids.numel(), peak=peak)


def summarize(per_rank: list[dict], schedules: list[str]) -> dict:
    names = list(per_rank[0]["times"])
    # A step's time is the slowest rank's.
    slowest = {n: [max(r["times"][n][i] for r in per_rank) for i in range(len(per_rank[0]["times"][n]))]
               for n in names}
    tokens = per_rank[0]["tokens"]
    rows = {n: dict(step_ms=statistics.median(slowest[n]), tokens_per_s=tokens / statistics.median(slowest[n]) * 1e3,
                    first_loss=per_rank[0]["first_loss"][n], peak_gib=max(r["peak"][n] for r in per_rank) / 2**30)
            for n in names}
    ratios = {}
    for s in schedules:
        peer = f"torch {TORCH[s]}"
        if peer in slowest:
            r = per_round(slowest[f"overlapkit {s}"], slowest[peer])
            ratios[s] = dict(ratio=r, verdict=verdict(r, TARGET), peer=peer)
    losses = [row["first_loss"] for row in rows.values()]
    return dict(rows=rows, ratios=ratios, loss_spread=max(losses) - min(losses))


def markdown(result: dict) -> str:
    out = [f"# HF Llama at pp {result['pp']}: overlapkit.pipeline() beside torch.distributed.pipelining",
           "", f"{result['device']}, {result['threads']} threads a rank, m={result['m']}, preset {result['preset']}; "
           f"first losses agree within {result['summary']['loss_spread']:.1e}", "",
           "| variant | step ms | tokens/s | peak GiB/rank | first loss |", "|---|---|---|---|---|"]
    for name, row in result["summary"]["rows"].items():
        out.append(f"| {name} | {row['step_ms']:.1f} | {row['tokens_per_s']:.0f} | {row['peak_gib']:.3f} | "
                   f"{row['first_loss']:.5f} |")
    out += ["", "peak GiB/rank: the most loaded rank's parameters and gradients plus the most its step holds for "
            "backward at once (every saved storage counted once while alive; CPU has no allocator peak)."]
    out += ["", f"| schedule | overlapkit / torch (median, middle half) | target <= {TARGET} |", "|---|---|---|"]
    for s, r in result["summary"]["ratios"].items():
        out.append(f"| {s} vs {r['peer']} | {text(r['ratio'])} | {r['verdict']} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = pipeline_args(__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu16")
    ap.add_argument("--schedules", default=",".join(TORCH), help=f"comma-separated, of {list(TORCH)}")
    args = ap.parse_args(argv)
    if args.smoke:
        args.preset, args.steps, args.warmup, args.world = "smoke", 2, 1, args.world or 2
    world = args.world or 4
    schedules = [s for s in args.schedules.split(",") if s]
    unknown = [s for s in schedules if s not in TORCH]
    if unknown:
        ap.error(f"--schedules: {unknown} not among {list(TORCH)}")
    m = args.microbatches or 2 * world
    per_rank = run_ranks(_rank_body, world, PRESETS[args.preset], schedules, m, args.steps, args.warmup, args.threads,
                         timeout_s=args.timeout if hasattr(args, "timeout") else 1800.0)
    result = dict(pp=world, m=m, threads=args.threads, preset=args.preset, device=device_label("cpu"),
                  summary=summarize(per_rank, schedules))
    write_results(result, os.path.join(out_dir(args), f"hf_pipeline_cpu_ws{world}"), markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
