"""Why ring attention's K/V transfers wait, from every rank's recorded spans of the same steps.

For each hop a rank waited for (a cp_kv span: issued when the rank posted its send and receive, ended
when its receive's wait returned), the matching send is the sending rank's span of the same name (the ring:
the previous rank; the all-gather schedule, `bulk`: rank r−i for the K/V block of step i, posted at the
start of the pass, and rank r+i for the dK/dV part of step i, posted after its step i). With
the ranks' clocks lined up (each recorder's wall-clock origin), the exposed part of the hop (its span
not covered by compute) splits into

- peer late: the data could not have arrived sooner, because the sending rank posted it later than
  this rank did (it finished its previous step late: skew, imbalance, its own waits);
- hop longer than the block: both posted in time, but a hop at the speed it has alone (ranks lined up,
  nothing else running) takes longer than the computation it hid behind;
- slower than alone: the data arrived later than issue + a hop's time alone: the transfer itself
  slowed down beside the computation (cores, memory bandwidth, the transport's threads) — or, under
  `bulk`, beside the other blocks in flight at once.

A stretch of waiting while several hops are in flight is counted once, for the hop that ends first after
it (the one waited for), so per rank and step the parts add up to the cp_kv time no compute covers.

Beside it: each step's block attention in the overlapped run against the sequential one (a block that
slows down while transfers run is contention on the compute side), the merge's share of a step, and the
spread of total compute over ranks (imbalance, which no overlap can hide).
"""

from __future__ import annotations

import re
import statistics

from _lib.unexported import intervals as iv


def _median(xs):
    return statistics.median(xs) if xs else None


def rank_spans(rec) -> dict:
    """What the parent needs of one rank's recorder: the wall-clock origin and plain span tuples."""
    return dict(origin=rec.origin_unix_ms, spans=[(s.kind, s.name, s.start_ms, s.end_ms, s.step) for s in rec.spans])


def sender(rank: int, name: str, size: int, schedule: str) -> int:
    """The rank whose send fills the receive `name` of `rank` under `schedule` ("bulk" or a ring's)."""
    if schedule != "bulk":
        return (rank - 1) % size
    i = int(re.search(r"\[(\d+)\]$", name).group(1))
    return (rank + i) % size if ".dkv[" in name else (rank - i) % size


def attribute(ranks: list[dict], hop_ms: dict[str, float], phases=("fwd", "bwd"), schedule: str = "pipelined") -> dict:
    """Per phase: exposed ms per step split into peer late / hop longer than block / slower than alone,
    and block, merge and imbalance numbers; medians over recorded steps (sums over hops and ranks / ranks).
    `hop_ms`: a hop alone, {"kv": the K/V blocks, "dkv": the fp32 dK/dV accumulator}; `schedule`: the overlap
    setting that ran ("bulk" or a ring's), which says who sent each hop."""
    size = len(ranks)
    by_rank = []
    for r in ranks:
        spans = [(k, n, a + r["origin"], b + r["origin"], st) for k, n, a, b, st in r["spans"]]
        by_rank.append(spans)
    steps = sorted({s[4] for spans in by_rank for s in spans})
    out = {}
    for phase in phases:
        per_step = []
        for st in steps:
            parts = dict(exposed=0.0, peer_late=0.0, hop_longer=0.0, slower=0.0)
            compute_total = []
            blocks, merges = [], []
            for r, spans in enumerate(by_rank):
                mine = [s for s in spans if s[4] == st]
                compute = iv.union((a, b) for k, n, a, b, _ in mine if k == "compute")
                compute_total.append(iv.length(iv.union((a, b) for k, n, a, b, _ in mine
                                                        if k == "compute" and f".{phase}[" in n)))
                blocks += [b - a for k, n, a, b, _ in mine if k == "compute" and f".{phase}[" in n
                           and not n.endswith(".merge") and not n.endswith(f".{phase}[0]")]
                merges += [b - a for k, n, a, b, _ in mine if k == "compute" and f".{phase}[" in n and n.endswith(".merge")]
                hops = sorted((s for s in mine if s[0] == "cp_kv" and f".{phase}." in s[1]), key=lambda s: s[3])
                # Time not covered by compute while hops were in flight; each stretch belongs to the hop that
                # ends first after it (the one being waited for): hops in flight together (all of bulk's, the
                # ring's K/V and dK/dV in backward) must not each count the same wait.
                unclaimed = iv.subtract(iv.union((s[2], s[3]) for s in hops), compute)
                for k, n, a, b, _ in hops:
                    peer = {pn: pa for pk, pn, pa, _, pst in by_rank[sender(r, n, size, schedule)]
                            if pst == st and pk == "cp_kv"}
                    claimed = iv.clip(unclaimed, a, b)
                    unclaimed = iv.subtract(unclaimed, claimed)
                    exposed = iv.length(claimed)
                    if exposed <= 0:
                        continue
                    hop = hop_ms["dkv" if ".dkv[" in n else "kv"]
                    wait_start = b - exposed
                    sent = peer.get(n, a)
                    expected = max(a, sent) + hop
                    explained = min(exposed, max(0.0, min(b, expected) - wait_start))
                    parts["exposed"] += exposed
                    parts["slower"] += exposed - explained
                    parts["peer_late" if sent > a else "hop_longer"] += explained
            row = {k: v / size for k, v in parts.items()}  # per rank
            row["compute_max_over_min"] = (max(compute_total) / min(compute_total)
                                           if compute_total and min(compute_total) > 0 else None)
            row["block_ms"] = _median(blocks)
            row["merge_ms"] = _median(merges)
            per_step.append(row)
        out[phase] = {k: _median([r[k] for r in per_step if r[k] is not None]) for k in per_step[0]} if per_step else {}
    return out
