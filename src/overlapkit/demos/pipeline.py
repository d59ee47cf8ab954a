"""`overlapkit demo --pp N --schedule S`: the tiny GPT cut into N pipeline stages (1F1B, interleaved,
ZB-H1, ZB-V or DualPipeV, overlap="bulk"), with TP+SP and DP inside every stage, checked against one
process every step; each stage's bubble (next to what the timetable prices) and exposed p2p printed
from the timeline.

Called by demos.gpt.run_rank when pp > 1; returns what it returns (errors and spans).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from ..launch import progress
from .checks import max_errors


def run_rank(cfg) -> dict:
    """One rank of the pipeline demo (the default group is initialized)."""
    from ..data_parallel import DataParallel
    from ..runtime.groups import ParallelGroups
    from ..models import GPT, GPTConfig, expected_local, gpt_chunks, lm_loss, parallelize
    from ..pipeline_parallel import PipelineConfig, PipelineEngine, pipeline_times, placement, price, timetable
    from ..tensor_parallel.layers import allreduce_sequence_parallel_grads
    from ..timeline import record

    groups = ParallelGroups.build(tp=cfg.tp, dp=cfg.dp, pp=cfg.pp)
    if cfg.device != "cpu":
        raise ValueError("overlapkit demo --pp runs on the CPU (gloo): pipeline stages need a GPU each")
    schedule = "interleaved-1f1b" if cfg.schedule == "interleaved" else cfg.schedule
    v = 1 if schedule in ("1f1b", "zb1p") else 2
    mcfg = GPTConfig(vocab_size=16 * cfg.tp, seq_len=8 * cfg.tp, hidden=16 * cfg.tp, num_heads=2 * cfg.tp,
                     ffn_hidden=32 * cfg.tp, num_layers=2 * cfg.pp * v)
    torch.manual_seed(cfg.seed)
    reference = GPT(mcfg)
    model = copy.deepcopy(reference)
    if cfg.tp > 1:
        model = parallelize(model, groups, sequence_parallel=True, overlap=cfg.overlap)
    chunks, layout = gpt_chunks(model, cfg.pp, groups.pp_rank, v, style=placement(schedule))
    if cfg.zero == 3:  # ZeRO-3: every chunk sharded over its stage's dp ranks (FSDP2 + overlapkit prefetch)
        from ..data_parallel import fully_shard
        chunks = [fully_shard(c, groups, overlap="auto") for c in chunks]
    elif cfg.dp > 1:
        chunks = [DataParallel(c, groups.dp, sequence_parallel_group=groups.tp if cfg.tp > 1 else None)
                  for c in chunks]
    m = 2 * cfg.pp
    engine = PipelineEngine(chunks, groups.pp, PipelineConfig(schedule, m, v, broadcast_loss=True), lm_loss)
    from ..optim import optim_param_groups
    # One group per kind (plain, DTensor per mesh): foreach kernels refuse lists mixing the two.
    opt = torch.optim.SGD(optim_param_groups([p for c in chunks for p in c.parameters()]), lr=0.5, foreach=True)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    rows = slice(groups.dp_rank * m, (groups.dp_rank + 1) * m)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    speaker = groups.tp_rank == 0 and groups.dp_rank == 0
    if groups.rank == 0:
        progress(f"model cut into pp={cfg.pp} stages (tp={cfg.tp} dp={cfg.dp} inside each), {schedule} with "
                 f"overlap=bulk, m={m} micro-batches:\n" + layout.describe())
    steps = []
    with record() as rec:
        for step in range(cfg.steps):
            idx = torch.randint(0, mcfg.vocab_size, (m * cfg.dp, mcfg.seq_len), generator=gen)
            tgt = torch.randint(0, mcfg.vocab_size, (m * cfg.dp, mcfg.seq_len), generator=gen)
            for c in chunks:  # module-wise: the optimizer's foreach zero_grad would mix DTensor and plain
                c.zero_grad(set_to_none=False)
            loss = engine.step(idx[rows], tgt[rows])
            if cfg.tp > 1 and cfg.dp == 1 and cfg.zero != 3:
                for c in chunks:
                    allreduce_sequence_parallel_grads(c, groups.tp)
            ref_opt.zero_grad()
            ref_loss = lm_loss(reference(idx), tgt)
            ref_loss.backward()
            full_loss = loss.detach().clone()
            dist.all_reduce(full_loss, group=groups.dp)
            full_loss /= cfg.dp
            pairs = [(full_loss, ref_loss)]
            if cfg.zero == 3:  # sharded over dp (and tp): compare the whole gradient
                ref_params = dict(reference.named_parameters())
                pairs += [(p.grad.full_tensor(), ref_params[n].grad) for c in chunks for n, p in c.named_parameters()]
            else:
                pairs += [(local, ref) for c in chunks for _, local, ref in expected_local(c, reference, "grad")]
            errs = torch.tensor(max_errors(pairs))
            dist.all_reduce(errs, op=dist.ReduceOp.MAX)
            steps.append(dict(step=step, loss=ref_loss.item(), abs_err=errs[0].item(), rel_err=errs[1].item()))
            opt.step()
            ref_opt.step()
            rec.next_step()
            if groups.rank == 0:
                progress(f"step {step + 1}/{cfg.steps}: loss {ref_loss.item():.4f}, "
                         f"max rel err vs one process {errs[1].item():.1e}")
    if speaker:
        t = pipeline_times(rec.spans, engine.timings[-1])
        split = schedule in ("zb1p", "zbv", "dualpipev")
        priced = price(timetable(schedule, cfg.pp, v, m), 1 / v, (1 if split else 2) / v, 1 / v if split else None)
        kept = engine.timings[-1].kept_w_peak_bytes
        progress(f"stage {groups.pp_rank}, last step: compute {t.compute_ms:.1f} ms, bubble {t.bubble_ms:.1f} ms "
                 f"({t.bubble_fraction:.2f} of compute; the timetable prices {priced.bubble_fraction:.2f} at "
                 f"F = B = W), p2p {t.p2p_ms:.1f} ms of which exposed {t.exposed_p2p_ms:.2f} ms (not counting the "
                 f"bubble)" + (f", weight-gradient inputs kept {kept / 1e3:.1f} kB at the peak" if split else ""))
    return dict(rank=groups.rank, steps=steps, spans=rec.spans, origin_unix_ms=rec.origin_unix_ms)
