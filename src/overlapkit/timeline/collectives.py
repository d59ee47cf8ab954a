"""The same collective on every rank that ran it, and the clock offsets that make its ends meet.

A collective completes on all its members at about the same time, once the last one has
arrived; that is what lines up the ranks' timelines and what the critical path crosses ranks at.

- The same collective: the i-th transfer of one (kind, message size, process group) on each
  rank (collectives of one group run in the same order on all its members; point-to-point left
  out). Members: the process group the trace names (`[0, 1]`), else every rank given; when the
  group is not named and the group size does not say it is everyone, the traces share a clock,
  the ranks whose i-th transfers **end together** (within END_TOLERANCE_MS or END_TOLERANCE_SHARE
  of the duration), so two TP groups' all-gathers are not taken for one collective.
- Clock offsets (`clock_offsets`): ranks on different hosts have clocks that disagree by up to
  milliseconds. The offset of a rank is the median, over the collectives it shares with a rank
  already placed, of (that rank's end − its end): the last member to arrive sets the end for all.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

from .phases import P2P_KINDS

END_TOLERANCE_MS = 0.05
"""Transfers of one collective instance end within this many ms of each other on its members ..."""
END_TOLERANCE_SHARE = 0.05
"""... or within this share of its median duration, whichever is larger."""


@dataclass(frozen=True)
class Instance:
    """One collective as its members ran it."""

    kind: str
    nbytes: int
    group: str
    index: int
    """The i-th of its (kind, size, group) on each member."""
    members: dict
    """rank -> index of the member's span in its trace's `spans`."""


def by_key(traces) -> dict[tuple, dict[int, list[int]]]:
    """(kind, nbytes, group) -> rank -> indices of that rank's transfers of it, in start order."""
    out: dict[tuple, dict[int, list[int]]] = defaultdict(dict)
    for t in traces:
        keyed = defaultdict(list)
        for i, s in enumerate(t.spans):
            if s.is_comm and s.kind not in P2P_KINDS:
                keyed[(s.kind, s.nbytes, s.group)].append(i)
        for key, idx in keyed.items():
            out[key][t.rank] = sorted(idx, key=lambda i: t.spans[i].start_ms)
    return out


def members(key: tuple, ranks: list[int]) -> list[int]:
    """The ranks running one collective together: the named group, else all ranks given."""
    group = key[2]
    if group.startswith("[") and group.endswith("]"):
        try:
            named = [int(x) for x in group[1:-1].split(",") if x.strip()]
            return [r for r in ranks if r in named]
        except ValueError:
            pass
    return ranks


def co_ending(spans: dict) -> list[list[int]]:
    """Ranks whose transfers end together: the members of one collective instance."""
    order = sorted(spans, key=lambda r: spans[r].end_ms)
    tol = max(END_TOLERANCE_MS, END_TOLERANCE_SHARE * statistics.median(s.duration_ms for s in spans.values()))
    groups = [[order[0]]]
    for prev, r in zip(order, order[1:]):
        if spans[r].end_ms - spans[prev].end_ms > tol:
            groups.append([])
        groups[-1].append(r)
    return groups


def instances(traces) -> list[Instance]:
    """Every collective instance with two or more members, over all the traces of one job."""
    by_rank = {t.rank: t for t in traces}
    shared_clock = len({t.origin_unix_ms for t in traces}) == 1
    out = []
    for key, idx in by_key(traces).items():
        group = members(key, sorted(idx))
        if len(group) < 2:
            continue
        for i in range(min(len(idx[r]) for r in group)):
            spans = {r: by_rank[r].spans[idx[r][i]] for r in group}
            known = key[2] or spans[group[0]].group_size == len(group)
            for together in ([group] if known or not shared_clock else co_ending(spans)):
                if len(together) >= 2:
                    out.append(Instance(kind=key[0], nbytes=key[1], group=key[2], index=i,
                                        members={r: idx[r][i] for r in together}))
    return out


def clock_offsets(traces, found: list[Instance]) -> dict[int, float]:
    """Per rank, ms to add to its times so that the collectives it shares end together (first rank: 0)."""
    by_rank = {t.rank: t for t in traces}
    diffs: dict[tuple[int, int], list[float]] = defaultdict(list)
    for inst in found:
        ranks = sorted(inst.members)
        for a in ranks:
            for b in ranks:
                if a != b:
                    diffs[(a, b)].append(by_rank[a].spans[inst.members[a]].end_ms
                                         - by_rank[b].spans[inst.members[b]].end_ms)
    ranks = sorted(by_rank)
    offsets = {ranks[0]: 0.0} if ranks else {}
    frontier = list(offsets)
    while frontier:  # breadth first from the first rank, over ranks that share collectives
        a = frontier.pop(0)
        for b in ranks:
            if b not in offsets and diffs.get((a, b)):
                offsets[b] = offsets[a] + statistics.median(diffs[(a, b)])
                frontier.append(b)
    return {r: offsets.get(r, 0.0) for r in ranks}


def align(traces, found: list[Instance]) -> dict[int, float]:
    """Shift each trace by its clock offset (in place); returns the offsets applied, ms."""
    offsets = clock_offsets(traces, found)
    for t in traces:
        t.shift(-offsets[t.rank])
    return offsets
