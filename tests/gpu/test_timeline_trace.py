"""On CUDA the profiler trace and the recorder's CUDA events must show the same DP step.

Every kernel launched inside an overlapkit range lies inside the recorded span of that name
or kind: a recorded span is bracketed by CUDA events on the streams the work ran on, so this
holds exactly, up to the clock offset estimated between the two sources.
"""

import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.profiler import ProfilerActivity, profile, schedule

from distributed import distributed
from overlapkit.data_parallel import DataParallel
from overlapkit.timeline import read_trace, record, report_spans
from overlapkit.timeline.agree import compare_spans

TOL_MS = 0.2  # CUDA events and CUPTI timestamps read one GPU clock; the offset is estimated


@distributed(world_size=None, backend="nccl", timeout_s=180)
def _profiled(trace_dir: str):
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = DataParallel(nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)]).to(dev), dist.group.WORLD,
                         first_bucket_mb=1.0, bucket_mb=4.0)
    x = torch.randn(512, 1024, device=dev)

    def step():
        model.zero_grad()
        F.mse_loss(model(x), x).backward()

    step()
    torch.cuda.synchronize(dev)
    path = f"{trace_dir}/rank{dist.get_rank()}.json"
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 schedule=schedule(wait=0, warmup=1, active=2, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(path)) as prof:
        with record(device=dev) as rec:
            for _ in range(3):
                step()
                prof.step()
                rec.next_step()
    trace = read_trace(path, last_step=True)
    recorded = [s for s in rec.spans if s.step in trace.steps]
    a = compare_spans(recorded, trace.spans, tol_ms=TOL_MS)
    traced = report_spans(trace.spans).ranks[0]
    return dict(world=dist.get_world_size(), steps=trace.steps, agreement=a, device=trace.device,
                traced_compute=sorted({s.name for s in trace.spans if s.is_compute and s.name in ("forward", "backward")}),
                traced_kinds=sorted(k.kind for k in traced.by_kind), compute_ms=traced.total.compute_ms,
                recorded_comm=[f"{s.kind}:{s.name}@{s.start_ms:.3f}" for s in recorded if s.is_comm])


def test_trace_and_recorder_agree_on_cuda():
    with tempfile.TemporaryDirectory() as d:
        results = _profiled(d)
    for r in results:
        a = r["agreement"]
        assert r["device"] == "gpu" and r["steps"] == [1, 2]
        assert r["traced_compute"] == ["backward", "forward"] and r["compute_ms"] > 0
        assert not a.unmatched, a  # every kernel of our ranges ran under its record
        assert max(a.early_ms, a.late_compute_ms, a.late_comm_ms) <= TOL_MS, a
        # one NCCL rank may launch nothing for an in-place all-reduce: only then may a
        # recorded transfer have no kernel
        computations_missing = [m for m in a.missing if m.startswith("compute:")]
        assert not computations_missing, a
        if r["world"] > 1:
            assert not a.missing and "dp_all_reduce" in r["traced_kinds"], a
