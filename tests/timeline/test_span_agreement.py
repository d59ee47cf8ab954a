"""Recorder against profiler, span by span: every engine's recorded step, profiled at the same time.

Each recorded span must hold its traced counterpart (the profiler range of the same computation,
the gloo transfer of the same kind) and every traced overlapkit span must lie in a recorded one;
a computation's traced time must equal its recorded time within the profiler's resolution.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile, schedule

from distributed import distributed
from overlapkit.launch import RankFailed
from overlapkit.timeline import read_trace, record
from overlapkit.timeline.agree import compare_spans

STEPS = 2
TOL_MS = 0.5
"""How far a traced computation may differ from its record, or a traced span stick out of it: two
wall clocks lined up by their origins, and a record's stamps taken just outside the profiler range."""
COMM_END_TOL_MS = 50.0
"""gloo closes a transfer's range on its own thread after the future the recorder stamps (timeline/agree.py)."""
WINDOWS = 5
"""Profiled windows an engine gets: a stall between a recorder stamp and the profiler range's edge does not
repeat, a disagreement of the two sources does. Measured on the 2 shared cores (tp pipelined, 80 windows):
one window in about seven had a GEMM differ by 0.2-1.1 ms, a different GEMM each time, and in 8 of the 12
largest the pause sat inside the profiler's own range-open call (record_function's enter taking as long as
the difference); no garbage collection ran inside any of them. Stamping inside the range instead moved the
same pauses to the other side (the range 0.5 ms longer than the record). Three windows in a row so paused
was seen once in ~15 module runs; five make it negligible without hiding a difference that repeats."""
ENGINES = ("tp bulk", "tp pipelined", "dp", "zero", "fully_shard", "ep", "cp", "pp")


def _tiny_gpt():
    from overlapkit.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, seq_len=8, hidden=16, num_heads=2, ffn_hidden=32, num_layers=2))


def _tokens(vocab: int, rows: int = 2, seq: int = 8):
    g = torch.Generator().manual_seed(dist.get_rank())
    return torch.randint(0, vocab, (rows, seq + 1), generator=g)


def _step_fn(engine: str):
    """A closure running one step of `engine` on this rank (2 ranks, tiny shapes)."""
    from overlapkit.models import lm_loss

    group = dist.group.WORLD
    if engine.startswith("tp"):
        from overlapkit import parallelize

        model = parallelize(_tiny_gpt(), group, overlap=engine.split()[1])
        idx = _tokens(32).fill_(3)  # the same tokens on both ranks: TP ranks share the batch
        return lambda: lm_loss(model(idx[:, :-1]), idx[:, 1:]).backward()
    if engine in ("dp", "zero"):
        from overlapkit.data_parallel import DataParallel, ShardedOptimizer

        model = DataParallel(_tiny_gpt(), group, bucket_mb=0.002)
        opt = ShardedOptimizer(model, torch.optim.SGD, group, lr=0.01) if engine == "zero" else None
        idx = _tokens(32)

        def dp_step():
            lm_loss(model(idx[:, :-1]), idx[:, 1:]).backward()
            if opt is not None:
                opt.step()
                opt.zero_grad()
        return dp_step
    if engine == "fully_shard":
        from torch.distributed.device_mesh import init_device_mesh

        from overlapkit.data_parallel import fully_shard

        torch.manual_seed(0)
        net = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)])
        model = fully_shard(net, init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)), prefetch=1)
        x = torch.randn(4, 16)
        return lambda: model(x).sum().backward()
    if engine == "ep":
        from overlapkit.expert_parallel import MoE

        torch.manual_seed(0)
        moe = MoE(16, 32, 4, 2, group, chunks=2)
        x = torch.randn(32, 16, requires_grad=True)
        return lambda: moe(x).sum().backward()
    if engine == "cp":
        from overlapkit.context_parallel import ContextParallelConfig, ring_attention, shard

        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))
        ql, kl, vl = (shard(t, 2, dist.get_rank(), 2, "zigzag").requires_grad_() for t in (q, k, v))
        cfg = ContextParallelConfig(overlap="pipelined", kernel="math")
        return lambda: ring_attention(ql, kl, vl, group, config=cfg).sum().backward()
    from overlapkit.pipeline_parallel import PipelineConfig, PipelineEngine

    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    pp = PipelineEngine([stage], group, PipelineConfig("1f1b", 4, overlap_p2p=True),
                        lambda out, t: ((out - t) ** 2).mean())
    x = torch.randn(8, 8)
    return lambda: pp.step(x if dist.get_rank() == 0 else None, x if dist.get_rank() == 1 else None)


def _window(step, path: str):
    """(agreement, recorded spans of the profiled steps) of one profiled window of `step`."""
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=0, active=STEPS, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(path)) as prof:
        with record() as rec:
            for _ in range(STEPS):
                step()
                prof.step()
                rec.next_step()
    trace = read_trace(path, last_step=True)
    recorded = [s for s in rec.spans if s.step in trace.steps]
    offset = rec.origin_unix_ms - trace.origin_unix_ms
    window_end = max(end for _, end in trace.step_ranges.values())  # a transfer still in flight then: cut
    return compare_spans(recorded, trace.spans, offset_ms=offset, tol_ms=TOL_MS, window_end_ms=window_end), recorded


@distributed(world_size=2, timeout_s=300.0)
def _profiled(trace_dir: str, engines: tuple[str, ...]):
    out = {}
    for engine in engines:
        step = _step_fn(engine)
        step()  # warm-up: agreements, allocations, first-call work outside the window
        for attempt in range(1, WINDOWS + 1):
            path = f"{trace_dir}/{engine.replace(' ', '_')}_{attempt}_rank{dist.get_rank()}.json"
            a, recorded = _window(step, path)
            bad = torch.tensor([0.0 if a.ok(TOL_MS, COMM_END_TOL_MS) else 1.0])
            dist.all_reduce(bad)  # every rank profiles another window, or none does
            if bad.item() == 0:
                break
        out[engine] = dict(agreement=a, attempts=attempt, recorded=len(recorded),
                           kinds=sorted({s.kind for s in recorded}))
    return out


@pytest.fixture(scope="module")
def agreements():
    # A rank under torch.profiler on gloo was seen killed by SIGSEGV about once in twenty runs of this
    # module (inside torch, before any window was compared; not reproduced alone): such a world runs once
    # more. Any other failure, and a second crash, fails every test here.
    for attempt in (1, 2):
        with tempfile.TemporaryDirectory() as d:
            try:
                return _profiled(d, ENGINES)
            except RankFailed as e:
                if attempt == 2 or "killed by SIG" not in str(e):
                    raise


@pytest.mark.parametrize("engine", ENGINES)
def test_every_recorded_span_has_its_profiler_range_and_back(agreements, engine):
    for rank, per_engine in enumerate(agreements):
        r = per_engine[engine]
        a = r["agreement"]
        assert r["recorded"] > 0 and "compute" in r["kinds"] and len(r["kinds"]) > 1, (rank, r)
        assert not a.missing and not a.unmatched, (rank, a)
        # cut: ZeRO's gather for the next step, issued just before the profiler stopped and never traced
        assert a.matched + len(a.cut) == r["recorded"] and len(a.cut) <= 1, (rank, a)
        assert a.compute_diff_ms <= TOL_MS, (rank, a.worst_compute)
        assert a.ok(TOL_MS, COMM_END_TOL_MS), (rank, a)


@distributed(world_size=2)
def _pipeline_batch_under_both():
    from overlapkit.runtime import comm

    peer = 1 - dist.get_rank()
    x, buf = torch.ones(64), torch.empty(64)
    with profile(activities=[ProfilerActivity.CPU]), record() as rec:
        send, (recv,) = comm.send_recv([(x, peer, 7)], [(buf, peer, 7)], dist.group.WORLD)
        polled = rec._watcher is not None  # noqa: SLF001 - whether anything polls the p2p works
        recv.wait()
        send.wait()
    return polled, sorted(s.kind for s in rec.spans), buf.sum().item()


def test_pipeline_transfers_are_stamped_by_their_wait_not_polled():
    # gloo's send/recv works tell their completion only when waited; a watcher polling them while a
    # profiler ran left a send that never completed (the 1F1B engine hung under both, one step in ~40)
    for polled, kinds, got in _pipeline_batch_under_both():
        assert not polled and kinds == ["pp_recv", "pp_send"] and got == 64.0
