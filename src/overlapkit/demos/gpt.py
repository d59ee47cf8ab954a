"""`overlapkit demo`: train the tiny GPT with TP+SP (and DP) and check every step against one process.

Each rank trains its shard; each rank also runs the unsharded model on the whole batch, and
after every step the loss, the logits and every gradient are compared (no communication is
needed for the check: each rank slices the reference the way its shard was sliced). The
timeline recorder is on throughout; its spans come back to the parent, which prints which
collectives each layer ran in forward and in backward, and the overlap report.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..launch import progress
from ..optim import optim_param_groups
from ..vocabulary import ParallelSizes, positive_int
from .checks import max_errors

_STARTED = time.monotonic()
"""When the demo module was imported: `overlapkit demo` imports it first thing."""

TOLERANCE = 1e-4
"""fp32 relative error allowed between parallel and single-process numbers (reduction order differs)."""


DEMO_SCHEDULES = ("1f1b", "interleaved", "zb1p", "zbv", "dualpipev")
"""The pipeline schedules `overlapkit demo --schedule` runs."""


@dataclass(frozen=True)
class DemoConfig:
    """What the demo runs."""

    tp: int = 2
    """Tensor-parallel size (ranks that split each GEMM)."""
    dp: int = 2
    """Data-parallel size (ranks that split the batch)."""
    steps: int = 3
    """Training steps, each checked against the single-process model."""
    overlap: str = "bulk"
    """Overlap mode of the TP layers: none, bulk or pipelined."""
    device: str = "cpu"
    """cpu (gloo) or cuda (NCCL, one GPU a rank)."""
    seed: int = 0
    """Seed of the model and the data; the same on every rank."""
    trace_dir: str | None = None
    """If set, every rank also runs torch.profiler and writes its trace there
    (rank<N>.json), ready for `overlapkit analyze`."""
    timeout_s: float = 120.0
    """Process-group timeout: a rank that stops answering fails the demo after this long."""
    ep: int = 1
    """Expert-parallel size, 1 or dp: with ep > 1 every second block's MLP is a MoE (2 experts a rank,
    top-2, 2 chunks) over the DP ranks, TP inside the experts, the dense layers TP without SP."""
    cp: int = 1
    """Context-parallel size: ranks that split each sequence (zigzag) and run ring attention over it;
    gradients then average over dp x cp ranks."""
    pp: int = 1
    """Pipeline-parallel size: > 1 cuts the GPT into pp stages run with `schedule` and overlap="bulk" (CPU
    only; with tp and dp inside every stage; not combined with ep or cp). See overlapkit.demos.pipeline."""
    schedule: str = "1f1b"
    """The pipeline schedule with pp > 1: 1f1b, interleaved (two chunks a rank), zb1p (ZB-H1), zbv (ZB-V)
    or dualpipev (DeepSeek's DualPipeV); the last two cut the GPT into two chunks a rank in a V."""
    zero: int = 0
    """0: gradients averaged by DataParallel; 3: ZeRO-3, the blocks sharded over dp with
    data_parallel.fully_shard (FSDP2, prefetch="auto") on the TP layers (TP without SP; with pp > 1
    every pipeline chunk is sharded over its stage's dp ranks, TP with SP); not with ep or cp."""

    @property
    def sizes(self) -> ParallelSizes:
        """The parallel sizes of the demo's world, as the mesh lays them out."""
        return ParallelSizes(tp=self.tp, dp=self.dp, pp=self.pp, ep=self.ep, cp=self.cp)

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "steps", "cp", "pp"):
            positive_int(getattr(self, name), f"DemoConfig.{name}")
        if self.ep != 1 and self.ep != self.dp:
            raise ValueError(f"DemoConfig.ep={self.ep} must be 1 or equal dp={self.dp} (the experts are carved out "
                             "of the whole data-parallel group)")
        if self.cp > 1 and self.ep > 1:
            raise ValueError(f"DemoConfig.cp={self.cp} with ep={self.ep}: the demo runs CP with dense MLPs only")
        if self.pp > 1 and (self.ep > 1 or self.cp > 1 or self.device != "cpu"):
            raise ValueError(f"DemoConfig.pp={self.pp} runs with tp and dp on the CPU only (got ep={self.ep}, "
                             f"cp={self.cp}, device={self.device!r})")
        if self.schedule not in DEMO_SCHEDULES:
            raise ValueError(f"DemoConfig.schedule={self.schedule!r} is not one of {DEMO_SCHEDULES}")
        if self.schedule != "1f1b" and self.pp < 2:
            raise ValueError(f"DemoConfig.schedule={self.schedule!r} is a pipeline schedule: it needs pp >= 2, "
                             f"got pp={self.pp}")
        if self.zero == 3 and self.schedule in ("zb1p", "zbv", "dualpipev"):
            raise ValueError(f"DemoConfig.schedule={self.schedule!r} defers weight gradients past the backward, "
                             "which fully_shard (zero=3) cannot take: use 1f1b or interleaved with zero=3")
        if self.zero not in (0, 3):
            raise ValueError(f"DemoConfig.zero={self.zero!r} must be 0 (DataParallel) or 3 (fully_shard)")
        if self.zero == 3 and (self.ep > 1 or self.cp > 1):
            raise ValueError(f"DemoConfig.zero=3 runs with tp, dp and pp only (got ep={self.ep}, cp={self.cp})")
        if not self.timeout_s > 0 or self.timeout_s == float("inf"):
            raise ValueError(f"DemoConfig.timeout_s must be a finite number of seconds > 0, got {self.timeout_s!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"DemoConfig.device={self.device!r} is not one of ('cpu', 'cuda')")


def run_rank(cfg: DemoConfig) -> dict:
    """The demo on one rank (the default group is initialized). Returns errors and spans."""
    from ..runtime.groups import ParallelGroups
    from ..models import GPT, GPTConfig, expected_local, lm_loss
    from ..models.parallelize_gpt import parallelize_gpt
    from ..timeline import record

    if cfg.pp > 1:
        from .pipeline import run_rank as run_pipeline_rank
        return run_pipeline_rank(cfg)
    groups = ParallelGroups.build(tp=cfg.tp, dp=cfg.dp, ep=cfg.ep, cp=cfg.cp)
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if cfg.device == "cuda" else "cpu")
    mcfg = GPTConfig(vocab_size=16 * cfg.tp, seq_len=8 * cfg.tp * cfg.cp, hidden=16 * cfg.tp, num_heads=2 * cfg.tp,
                     ffn_hidden=32 * cfg.tp, num_layers=2)
    torch.manual_seed(cfg.seed)
    if cfg.ep > 1:  # the experts are sharded: DataParallel would average different experts together
        from ..models.moe_gpt import expected_local_ep as expected_local, moe_gpts
        reference, model = moe_gpts(mcfg, groups, cfg.seed, device=device, overlap=cfg.overlap)
    else:
        reference = GPT(mcfg).to(device)
        model = copy.deepcopy(reference)
    if cfg.zero == 3:
        import logging

        # The check below gathers every 2-D (dp, tp) gradient whole; DTensor warns each time that
        # this takes two gathers. It is the check's cost, not the training's: keep the output readable.
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    model, replicas = parallelize_gpt(model, groups, overlap=cfg.overlap, zero=cfg.zero, tensor_parallel=cfg.ep == 1)
    # One param group per kind (plain, DTensor on each mesh): torch's foreach kernels (CUDA's
    # default) refuse a list mixing DTensor (TP layers) and plain (norms, embeddings) parameters.
    # foreach=True on CPU too, so that the demo's tests run the kernels CUDA picks by default.
    opt = torch.optim.SGD(optim_param_groups(model), lr=0.5, foreach=True)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    batch = 2 * cfg.dp
    rows = slice(groups.dp_rank * 2, groups.dp_rank * 2 + 2)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    steps = []
    show = groups.rank == 0
    if show:
        progress(f"model built (tp={cfg.tp} dp={cfg.dp}{f' cp={cfg.cp}' if cfg.cp > 1 else ''}{' ZeRO-3' if cfg.zero == 3 else ''}, overlap={cfg.overlap}); training {cfg.steps} steps")
    with record(device=device) as rec, _profiler(cfg.trace_dir, groups.rank, device, cfg.steps) as prof:
        for step in range(cfg.steps):
            idx = torch.randint(0, mcfg.vocab_size, (batch, mcfg.seq_len), generator=gen).to(device)
            tgt = torch.randint(0, mcfg.vocab_size, (batch, mcfg.seq_len), generator=gen).to(device)
            # Module-wise: the optimizer's zero_grad(set_to_none=False) with foreach zeroes all its
            # groups' grads in one foreach call per device and dtype, mixing DTensor and plain again.
            model.zero_grad(set_to_none=False)
            mine, my_tgt = idx[rows], tgt[rows]
            if cfg.cp > 1:  # this CP rank's slice of every sequence (its positions follow inside the model)
                from ..context_parallel import shard_batch
                mine, my_tgt = shard_batch(mine, groups.cp)[0], shard_batch(my_tgt, groups.cp)[0]
            logits = model(mine)
            loss = lm_loss(logits, my_tgt)
            loss.backward()
            if cfg.ep > 1:
                from ..expert_parallel import average_data_parallel_grads
                average_data_parallel_grads(model, groups.dp, groups.ep)

            ref_opt.zero_grad()
            ref_logits = reference(idx)
            ref_loss = lm_loss(ref_logits, tgt)
            ref_loss.backward()

            # The loss of this DP (x CP) rank covers its rows (and tokens): the mean over them is the full loss.
            full_loss = loss.detach().clone()
            dist.all_reduce(full_loss, group=replicas)
            full_loss /= cfg.dp * cfg.cp
            if hasattr(logits, "full_tensor"):  # vocabulary-parallel logits: a DTensor sharded over TP
                logits = logits.full_tensor()
            ref_mine = ref_logits[:, rows]
            if cfg.cp > 1:
                from ..context_parallel import shard
                ref_mine = shard(ref_mine, 0, groups.cp_rank, cfg.cp, "zigzag")
            pairs = [(full_loss, ref_loss), (logits, ref_mine)]
            if cfg.zero == 3:  # sharded over dp (and tp): compare the whole gradient
                ref_params = dict(reference.named_parameters())
                pairs += [(p.grad.full_tensor(), ref_params[n].grad) for n, p in model.named_parameters()]
            else:
                pairs += [(local, ref) for _, local, ref in expected_local(model, reference, "grad")]
            errs = torch.tensor(max_errors(pairs), device=device)
            dist.all_reduce(errs, op=dist.ReduceOp.MAX)
            steps.append(dict(step=step, loss=ref_loss.item(), abs_err=errs[0].item(), rel_err=errs[1].item()))
            opt.step()
            ref_opt.step()
            rec.next_step()
            if prof is not None:
                prof.step()
            if show:
                progress(f"step {step + 1}/{cfg.steps}: loss {ref_loss.item():.4f}, "
                         f"max rel err vs one process {errs[1].item():.1e}")
    out = dict(rank=groups.rank, steps=steps, spans=rec.spans, origin_unix_ms=rec.origin_unix_ms)
    if cfg.ep > 1:
        from ..models.moe_gpt import moe_loads
        out["moe_loads"] = moe_loads(model)
    return out


@contextlib.contextmanager
def _profiler(trace_dir: str | None, rank: int, device: torch.device, steps: int):
    """torch.profiler over the steps (each a ProfilerStep#N), exported to trace_dir/rank<N>.json."""
    if trace_dir is None:
        yield None
        return
    from torch.profiler import ProfilerActivity, profile, schedule
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    os.makedirs(trace_dir, exist_ok=True)
    path = os.path.join(trace_dir, f"rank{rank}.json")
    # A schedule makes the profiler mark each step (ProfilerStep#N), which the analyzer reports on.
    with profile(activities=activities, schedule=schedule(wait=0, warmup=0, active=steps, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(path)) as prof:
        yield prof


_PHASE = re.compile(r"^(?P<layer>.+?)\.(?P<phase>fwd|bwd)(?:\.[\w.]+)?(?:\[[^\]]*\])?$")


def collectives_by_layer(spans, step: int = 0) -> dict[str, dict[str, list[str]]]:
    """{layer: {"fwd": [kinds…], "bwd": [kinds…]}} from one step's communication spans of one rank.

    Transfer names are `<layer>.<fwd|bwd>[.<gemm>][<chunk>]`; the chunks of one pipelined
    collective count once. Names without a phase (a gradient sync) are listed under backward.
    """
    out: dict[str, dict[str, list[str]]] = {}
    for s in sorted(spans, key=lambda s: s.start_ms):
        if not s.is_comm or s.step != step:
            continue
        m = _PHASE.match(s.name)
        layer, phase = (m.group("layer"), m.group("phase")) if m else (s.name, "bwd")
        kinds = out.setdefault(layer, {"fwd": [], "bwd": []})[phase]
        kind = s.kind.removeprefix("tp_").removeprefix("dp_").replace("_", "-")
        if not kinds or kinds[-1] != kind:
            kinds.append(kind)
    return out


def say(text: str) -> None:
    """One plain progress line on stderr with the seconds since the demo started: readable piped too."""
    print(f"[{time.monotonic() - _STARTED:5.1f}s] {text}", file=sys.stderr, flush=True)


def check_world(cfg: DemoConfig, oversubscribe: bool = False) -> None:
    """Refuse (ValueError), before any rank starts, a world this machine cannot run: more GPUs than it has,
    or far more CPU ranks than cores (unless `oversubscribe`). Under torchrun the ranks exist already: nothing to refuse."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    world = cfg.sizes.world_size
    if cfg.device == "cuda":
        if torch.cuda.device_count() < world:
            raise ValueError(f"--device cuda needs tp*dp*cp*pp={world} GPUs, this machine has "
                             f"{torch.cuda.device_count()} (NCCL refuses two ranks on one GPU)")
        return
    if not oversubscribe:
        from ..launch import check_world_fits
        sizes = " ".join(f"--{k} {v}" for k, v in (("tp", cfg.tp), ("dp", cfg.dp), ("cp", cfg.cp), ("pp", cfg.pp))
                         if v > 1)
        check_world_fits(world, "gloo", sizes or "1 rank", force="--oversubscribe")


def run(cfg: DemoConfig, plot_path: str | None = "timeline.png", oversubscribe: bool = False) -> int:
    """Run the demo (spawning ranks, or in-process under torchrun) and print the results."""
    from ..launch import spawn

    world = cfg.sizes.world_size
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: this process is a rank
        from ..runtime.groups import init
        init(tp=cfg.tp, dp=cfg.dp, cp=cfg.cp, pp=cfg.pp, backend="nccl" if cfg.device == "cuda" else "gloo", timeout_s=cfg.timeout_s)
        from ..launch import shutdown
        rank, ok = dist.get_rank(), False
        try:
            results = [run_rank(cfg)]
            ok = True
        finally:
            shutdown(joined=ok)
        if rank != 0:
            return 0 if results[0]["steps"][-1]["rel_err"] <= TOLERANCE else 1
    else:
        check_world(cfg, oversubscribe)
        backend = "nccl" if cfg.device == "cuda" else "gloo"
        say(f"starting {world} {backend} ranks (each imports torch first, a few seconds)")
        results = spawn(run_rank, world, cfg, backend=backend, timeout_s=cfg.timeout_s,
                        on_message=lambda rank, text: say(f"rank {rank}: {text}"), oversubscribe=True)
        say("all ranks finished; results follow")
    return print_results(cfg, results, plot_path)


def print_results(cfg: DemoConfig, results: list[dict], plot_path: str | None) -> int:
    """Per-step errors, per-layer collectives, the overlap report; exit code 1 if a check failed."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    steps = results[0]["steps"]
    pipeline = f" pp={cfg.pp} {cfg.schedule}" if cfg.pp > 1 else ""
    table = Table(title=f"tp={cfg.tp} dp={cfg.dp}{f' cp={cfg.cp}' if cfg.cp > 1 else ''}{pipeline} overlap={cfg.overlap} "
                        "vs one process (fp32)")
    for col in ("step", "loss", "max abs err", "max rel err", "check"):
        table.add_column(col, justify="right")
    ok = True
    for s in steps:
        good = s["rel_err"] <= TOLERANCE
        ok &= good
        table.add_row(str(s["step"]), f"{s['loss']:.5f}", f"{s['abs_err']:.2e}", f"{s['rel_err']:.2e}",
                      "[green]ok[/green]" if good else f"[red]> {TOLERANCE:g}[/red]")
    console.print(table)

    layers = Table(title="collectives per layer, rank 0, step 0: backward mirrors forward")
    for col in ("layer", "forward", "backward"):
        layers.add_column(col)
    for layer, phases in collectives_by_layer(results[0]["spans"]).items():
        layers.add_row(layer, ", ".join(phases["fwd"]) or "-", ", ".join(phases["bwd"]) or "-")
    console.print(layers)
    if "moe_loads" in results[0]:  # EP: what the routers did in the last step, over the EP ranks of DP row 0
        from ..timeline.report import load_imbalance
        ep_ranks = [r for r in results if r["rank"] % cfg.tp == 0]
        for i, (layer, _, _) in enumerate(results[0]["moe_loads"]):
            load = load_imbalance([r["moe_loads"][i][1] for r in ep_ranks], sum(r["moe_loads"][i][2] for r in ep_ranks))
            console.print(f"{layer}, last step: {load.line()}")

    # Every rank's spans on one clock (the ranks' recorders started at different moments).
    origin = min(r["origin_unix_ms"] for r in results)
    spans = [s.shifted(origin - r["origin_unix_ms"]) for r in results for s in r["spans"]]
    from ..timeline import print_report, report_spans
    report = report_spans(spans)
    print_report(report, console=console)
    if plot_path:
        from ..timeline.plot import plot_spans, write_chrome_trace
        # Step 0 pays for start-up (ranks joining their first collective at different times):
        # the picture shows the steps after it, the report above covers every step.
        shown = [s for s in spans if s.step != 0] if cfg.steps > 1 else spans
        steps = f"steps 1-{cfg.steps - 1}" if cfg.steps > 1 else "step 0"
        plot_spans(shown, plot_path, title=f"overlapkit demo: tp={cfg.tp} dp={cfg.dp} overlap={cfg.overlap}, {steps}")
        perfetto = os.path.splitext(plot_path)[0] + "_perfetto.json"
        write_chrome_trace(spans, perfetto)
        console.print(f"timeline picture: {plot_path}; the same spans for Perfetto / chrome://tracing: {perfetto}")
    console.print("[green]demo passed[/green]" if ok else "[red]demo FAILED: parallel and single-process numbers differ[/red]")
    return 0 if ok else 1
