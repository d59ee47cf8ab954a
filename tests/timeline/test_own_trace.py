"""A trace of our own: the profiler and the recorder watch the same gloo step and must agree."""

import tempfile

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, schedule

from distributed import distributed
from overlapkit.runtime import comm
from overlapkit.timeline import compute_span, read_trace, record, report_spans
from overlapkit.timeline.agree import compare_spans

STEPS = 2


def _step(x: torch.Tensor, gathered: torch.Tensor) -> None:
    """A TP-style all-gather and a DP-style all-reduce, each issued before an independent GEMM."""
    h = comm.all_gather(gathered, x, dist.group.WORLD, kind="tp_all_gather", name="ag")
    with compute_span("mm.ag"):
        y = x @ x
    h.wait()
    h = comm.all_reduce(y, dist.group.WORLD, kind="dp_all_reduce", name="ar")
    with compute_span("mm.ar"):
        (x @ x.T).sum()
    h.wait()


@distributed(world_size=2)
def _profiled(trace_dir: str):
    torch.manual_seed(dist.get_rank())
    x, gathered = torch.randn(96, 96), torch.empty(192, 96)
    path = f"{trace_dir}/rank{dist.get_rank()}.json"
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=0, active=STEPS, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(path)) as prof:
        with record() as rec:
            for _ in range(STEPS):
                _step(x, gathered)
                prof.step()
                rec.next_step()
    full = read_trace(path, last_step=True)
    default = read_trace(path)
    agreement = compare_spans(rec.spans, full.spans, offset_ms=rec.origin_unix_ms - full.origin_unix_ms)
    both = report_spans(rec.spans).ranks[0], report_spans(full.spans).ranks[0]
    return dict(
        rank=full.rank, device=full.device, agreement=agreement,
        rec_kinds=sorted((s.kind, s.name, s.step) for s in rec.spans),
        trace_kinds=sorted((s.kind, s.name if s.is_compute else "", s.step) for s in full.spans),
        trace_steps=full.steps, default_steps=default.steps, dropped=default.dropped_step,
        comm_counts=[{k.kind: k.count for k in r.by_kind} for r in both],
    )


def test_reader_and_recorder_agree_on_a_gloo_step():
    with tempfile.TemporaryDirectory() as d:
        results = _profiled(d)
    for rank, r in enumerate(results):
        a = r["agreement"]
        assert r["rank"] == rank and r["device"] == "cpu"
        # every recorded span holds its traced counterpart and nothing traced is left over; a
        # gloo range closes after the future the recorder stamps, so transfer ends get slack
        assert a.ok(tol_ms=0.5, comm_end_tol_ms=50.0), a
        assert a.matched == len(r["rec_kinds"]) == 4 * STEPS, a
        # the same computations (by name) and transfers (by kind), in the same steps
        # (the trace also counts the CPU ops the main thread ran outside those ranges, as `cpu ops`)
        compute_rec = [k for k in r["rec_kinds"] if k[0] == "compute"]
        compute_tr = [k for k in r["trace_kinds"] if k[0] == "compute" and k[1] != "cpu ops"]
        assert compute_rec == compute_tr
        assert {k for k in r["trace_kinds"] if k[0] != "compute"} == {
            (kind, "", step) for kind in ("tp_all_gather", "dp_all_reduce") for step in range(STEPS)}
        assert r["comm_counts"][0] == {"tp_all_gather": STEPS, "dp_all_reduce": STEPS}
        assert r["comm_counts"][1]["tp_all_gather"] == STEPS
        # the last ProfilerStep is left out by default, kept on request
        assert r["trace_steps"] == list(range(STEPS))
        assert r["default_steps"] == list(range(STEPS - 1)) and r["dropped"] == STEPS - 1
