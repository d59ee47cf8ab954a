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
from .phases import P2P_KINDS

STRAGGLER_MS = 0.05
"""A straggler is behind by at least this many ms per step ..."""
STRAGGLER_SHARE = 0.05
"""... and by at least this share of the median step time."""
END_TOLERANCE_MS = 0.05
"""Transfers of one collective instance end within this many ms of each other on its members ..."""
END_TOLERANCE_SHARE = 0.05
"""... or within this share of its median duration, whichever is larger."""
SLOW_GROUP_SHARE = 0.5
"""A group whose bus bandwidth is below this share of its peers' median is flagged."""


def _instances(traces) -> dict[tuple, dict[int, list]]:
    """(kind, nbytes, group) -> rank -> that rank's transfers of it, in start order."""
    out: dict[tuple, dict[int, list]] = defaultdict(dict)
    for t in traces:
        by_key = defaultdict(list)
        for s in t.spans:
            if s.is_comm and s.kind not in P2P_KINDS:
                by_key[(s.kind, s.nbytes, s.group)].append(s)
        for key, ss in by_key.items():
            out[key][t.rank] = sorted(ss, key=lambda s: s.start_ms)
    return out


def _members(key: tuple, ranks: list[int]) -> list[list[int]]:
    """The sets of ranks running one collective together: the named group, else all ranks given."""
    group = key[2]
    if group.startswith("[") and group.endswith("]"):
        try:
            named = [int(x) for x in group[1:-1].split(",") if x.strip()]
            return [[r for r in ranks if r in named]]
        except ValueError:
            pass
    return [ranks]


def _co_ending(spans: dict[int, object]) -> list[list[int]]:
    """Ranks whose transfers end together: the members of one collective instance (see rank_waits)."""
    order = sorted(spans, key=lambda r: spans[r].end_ms)
    tol = max(END_TOLERANCE_MS, END_TOLERANCE_SHARE * statistics.median(s.duration_ms for s in spans.values()))
    groups = [[order[0]]]
    for prev, r in zip(order, order[1:]):
        if spans[r].end_ms - spans[prev].end_ms > tol:
            groups.append([])
        groups[-1].append(r)
    return groups


def rank_waits(traces, n_steps: dict[int, int]) -> dict[int, float]:
    """Per rank, ms per step spent inside collectives waiting for the last rank to arrive.

    Who ran a collective together: the process group the trace names, or all the ranks given
    when the group size says so; else, when the traces share a clock, the ranks whose i-th transfers of it end together (within END_TOLERANCE_MS or
    END_TOLERANCE_SHARE of its duration: a collective completes on all members at once), so two
    TP groups' all-gathers are not taken for one; else every rank that ran it.
    """
    wait = {t.rank: 0.0 for t in traces}
    shared_clock = len({t.origin_unix_ms for t in traces}) == 1
    for key, by_rank in _instances(traces).items():
        for members in _members(key, sorted(by_rank)):
            if len(members) < 2:
                continue
            for i in range(min(len(by_rank[r]) for r in members)):
                instance = {r: by_rank[r][i] for r in members}
                known = key[2] or instance[members[0]].group_size == len(members)
                together = [members] if known or not shared_clock else _co_ending(instance)
                for group in together:
                    if len(group) < 2:
                        continue
                    fastest = min(instance[r].duration_ms for r in group)
                    for r in group:
                        wait[r] += instance[r].duration_ms - fastest
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
    for (kind, nbytes, group), by_rank in _instances(traces).items():
        if not group or nbytes <= 0:
            continue
        members = _members((kind, nbytes, group), sorted(by_rank))[0]
        if not members:
            continue
        count = min(len(by_rank[r]) for r in members)
        times = [min(by_rank[r][i].duration_ms for r in members) for i in range(count)]
        n = by_rank[members[0]][0].group_size
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
