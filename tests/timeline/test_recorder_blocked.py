"""A compute span that encloses a synchronous collective computed only while it was not waiting."""

import time

import torch
import torch.distributed as dist

from distributed import distributed
from overlapkit.runtime import comm
from overlapkit.timeline import compute_span, record


@distributed(world_size=2)
def _region_with_wait():
    x = torch.ones(8)
    with record() as rec:
        with compute_span("forward"):
            time.sleep(0.05)                      # compute before the collective
            if dist.get_rank() == 1:
                time.sleep(0.2)                   # rank 0 now waits ~0.2 s in the all-reduce
            comm.all_reduce(x, dist.group.WORLD, kind="tp_all_reduce", name="ar", async_op=False)
            time.sleep(0.05)                      # compute after it
    compute = [s for s in rec.spans if s.is_compute]
    ar = next(s for s in rec.spans if s.is_comm)
    return [(s.start_ms, s.end_ms) for s in compute], (ar.start_ms, ar.end_ms)


def test_wait_inside_compute_region_is_not_compute():
    pieces, ar = _region_with_wait()[0]
    assert len(pieces) == 2, pieces                # the region is split around the wait
    (a0, a1), (b0, b1) = pieces
    assert a1 - a0 >= 45 and b1 - b0 >= 45          # both halves of real compute kept
    assert a1 <= b0 and b0 - a1 >= 150              # the ~200 ms wait is carved out
    assert ar[0] <= a1 and b0 - ar[1] < 5.0          # and it lies in the collective's span (the wait returns just after the completion stamp)
