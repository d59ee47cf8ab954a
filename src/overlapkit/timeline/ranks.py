"""Across ranks: who waits inside collectives, for whom, and which group moves bytes slowly.

A collective finishes on every rank at about the same time, once the last rank has arrived, so
the time a rank spends inside it beyond the fastest rank's time is time spent waiting for
others. That needs no common clock: only the durations of the same collective on each rank.

- The same collective: the i-th transfer of one (kind, message size, process group) on each
  rank (collectives of one group run in the same order on all its members; p2p is left out);
  when the trace names no process group, the members are told apart by ending together.
- wait of rank r in it = its duration − the shortest duration among the ranks;
  `wait_ms` of a rank = the sum over its collectives, per step.
- behind_ms of rank r = median over the other ranks of their wait_ms − r's wait_ms: how much
  longer the others waited than r did — how late r arrived, per step. A rank is a straggler
  when it is behind by at least STRAGGLER_MS and STRAGGLER_SHARE of the median step.
- A slow group: for groups of the same size running the same collective and message size
  (process groups named in the trace), bus bandwidth of each from its members' shortest
  duration (waits removed); a group below SLOW_GROUP_SHARE of its peers' median is flagged
  (a group spanning nodes, or a bad NVLink/NIC mapping).
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from .bandwidth import bus_factor
from .collectives import by_key, instances, members

STRAGGLER_MS = 0.05
"""A straggler is behind by at least this many ms per step ..."""
STRAGGLER_SHARE = 0.05
"""... and by at least this share of the median step time."""
SLOW_GROUP_SHARE = 0.5
"""A group whose bus bandwidth is below this share of its peers' median is flagged."""


def rank_waits(traces, n_steps: dict[int, int], found=None) -> dict[int, float]:
    """Per rank, ms per step spent inside collectives waiting for the last rank to arrive.

    Who ran a collective together: `timeline/collectives.py` (the named process group, all ranks,
    or the ranks whose transfers end together). `found`: its instances, when already computed.
    """
    by_rank = {t.rank: t for t in traces}
    wait = {t.rank: 0.0 for t in traces}
    for inst in instances(traces) if found is None else found:
        durations = {r: by_rank[r].spans[i].duration_ms for r, i in inst.members.items()}
        fastest = min(durations.values())
        for r, d in durations.items():
            wait[r] += d - fastest
    return {r: w / max(1, n_steps.get(r, 1)) for r, w in wait.items()}


def stragglers(waits: dict[int, float], step_ms: dict[int, float]) -> list[dict]:
    """[{rank, behind_ms}] of the ranks the others wait for, most behind first."""
    if len(waits) < 2:
        return []
    median_step = statistics.median(step_ms.values()) if step_ms else 0.0
    threshold = max(STRAGGLER_MS, STRAGGLER_SHARE * median_step)
    out = []
    for r, w in waits.items():
        behind = statistics.median([v for s, v in waits.items() if s != r]) - w
        if behind >= threshold:
            out.append({"rank": r, "behind_ms": behind})
    return sorted(out, key=lambda x: -x["behind_ms"])


def slow_groups(traces) -> list[dict]:
    """[{group, kind, nbytes, busbw_gbps, peers_median_gbps}] for groups far slower than their peers."""
    by_shape: dict[tuple, dict[str, float]] = defaultdict(dict)
    spans_of = {t.rank: t.spans for t in traces}
    for (kind, nbytes, group), idx in by_key(traces).items():
        if not group or nbytes <= 0:
            continue
        ranks = members((kind, nbytes, group), sorted(idx))
        if not ranks:
            continue
        count = min(len(idx[r]) for r in ranks)
        times = [min(spans_of[r][idx[r][i]].duration_ms for r in ranks) for i in range(count)]
        n = spans_of[ranks[0]][idx[ranks[0]][0]].group_size
        if not times or n < 2 or statistics.median(times) <= 0:
            continue
        by_shape[(kind, nbytes, n)][group] = nbytes * bus_factor(kind, n) / (statistics.median(times) * 1e6)
    out = []
    for (kind, nbytes, _), bw in by_shape.items():
        if len(bw) < 2:
            continue
        for group, gbps in bw.items():
            peers = statistics.median([v for g, v in bw.items() if g != group])
            if gbps < SLOW_GROUP_SHARE * peers:
                out.append({"group": group, "kind": kind, "nbytes": nbytes, "busbw_gbps": gbps,
                            "peers_median_gbps": peers})
    return out
