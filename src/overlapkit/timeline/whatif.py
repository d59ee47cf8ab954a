"""What the step would take if one thing on its critical path changed, computed on the path.

From the per-step paths of `timeline/critical_path.py` (means over the steps):

- **collective X fully hidden**: the path's exposed-comm segments of X are gone;
- **launch gaps removed**: the path's host-launch-gap segments are gone (the GPU never waits for
  the host: CUDA graphs, a leaner host loop), but the step is never shorter than the busiest rank's
  own work (`Path.busy_ms`);
- **rank k as fast as the median of the others**: at every collective where the path crossed to
  rank k because it was ready last, the collective starts instead at the later of when the last
  other member had issued it and when k would have, at the others' median pace from its step's
  start (`Crossing.median_ms`);
- with the cost model (`overlapkit analyze --config ... --what-if overlap=...`, joined in the
  tools layer): each exposed kind's segments shrink by the share the model predicts the change
  hides (`scaled`).

Each answer is first-order: another chain, shorter until now, may become critical and take
back part of the saving, so a predicted step is a lower bound on the changed step.
"""

from __future__ import annotations

import statistics

PROCESS_KINDS = ("tp_", "dp_", "zero_", "ep_", "pp_", "cp_")
"""Prefixes overlapkit's and the cost model's kinds add to a collective's name."""


def _mean(values) -> float:
    values = list(values)
    return statistics.mean(values) if values else 0.0


def measured_ms(paths) -> float:
    """The mean step as its critical path explains it."""
    return _mean(p.path_ms for p in paths)


def hidden(paths, kind: str) -> float:
    """Mean ms per step the path spends in exposed `kind` communication."""
    return _mean(sum(s.ms for s in p.segments if s.why == "exposed comm" and s.kind == kind) for p in paths)


def launch_gaps(paths) -> float:
    """Mean ms per step saved if the GPU never waited for the host: the path's host-launch-gap segments,
    but never below the busiest rank's own work (its lanes' busy time: then the GPU is the path)."""
    return _mean(max(0.0, min(p.ms_by("host launch gap"), p.path_ms - p.busy_ms)) for p in paths)


def rank_at_median(paths, rank: int) -> float:
    """Mean ms per step saved if `rank` arrived at its collectives at the others' median pace.

    Crossings are taken latest first; one that falls inside a stretch already saved (its rank was
    ready after the new start of a later one) is part of that saving, not another: under DDP the
    others' own progress does not wait for the earlier buckets, so the later bucket's lateness holds
    the earlier ones. One before that new start adds (the others blocked on it before going on)."""
    def saved(p) -> float:
        total, floor = 0.0, float("inf")
        for c in sorted((c for c in p.crossings if c.rank == rank), key=lambda c: -c.ready_ms):
            if c.ready_ms > floor + 1e-9:
                continue
            start = max(c.others_ms, c.median_ms)
            total += max(0.0, c.ready_ms - start)
            floor = min(floor, start)
        return total
    return _mean(saved(p) for p in paths)


def base_kind(kind: str) -> str:
    """`dp_all_reduce` -> `all_reduce`: a collective's name without the engine prefix."""
    for prefix in PROCESS_KINDS:
        if kind.startswith(prefix):
            return kind[len(prefix):]
    return kind


def scaled(paths, hidden_share: dict) -> float:
    """Mean ms per step saved if each kind's exposed segments shrank by `hidden_share[kind]` (0..1)
    (kinds match with or without their engine prefix)."""
    share = {base_kind(k): v for k, v in hidden_share.items()}
    share.update(hidden_share)
    return _mean(sum(s.ms * share.get(s.kind, share.get(base_kind(s.kind), 0.0)) for s in p.segments
                     if s.why == "exposed comm") for p in paths)


def questions(paths, top: int = 3) -> list[dict]:
    """The standard questions on these paths, largest saving first:
    [{question, saving_ms, step_ms, measured_ms}] per step (means over the steps)."""
    if not paths:
        return []
    base = measured_ms(paths)
    out = []
    kinds = sorted({s.kind for p in paths for s in p.segments if s.why == "exposed comm"})
    for kind in kinds:
        out.append((f"{kind} fully hidden", hidden(paths, kind)))
    if (gap := launch_gaps(paths)) > 0:
        out.append(("host launch gaps removed", gap))
    for rank in sorted({c.rank for p in paths for c in p.crossings}):
        out.append((f"rank {rank} as fast as the median of the others", rank_at_median(paths, rank)))
    rows = [dict(question=q, saving_ms=s, step_ms=base - s, measured_ms=base) for q, s in out if s > 0]
    rows.sort(key=lambda r: -r["saving_ms"])
    return rows[:top * 3]


def answer(paths, question: str, ranks=None, kinds=None) -> dict:
    """One question by name: `hide=KIND`, `rank=K`, or `launch-gaps` -> {question, saving_ms, step_ms,
    measured_ms}. ValueError on another, and on a rank not in `ranks` or a kind not in `kinds` (the
    traces' ranks and communication kinds, when given): "saves 0" would read as an answer."""
    key, _, value = question.partition("=")
    key = key.strip().replace("_", "-")
    if key == "hide" and value:
        if kinds is not None and value not in kinds:
            raise ValueError(f"--what-if {question!r}: the traces have no {value!r} communication; their kinds: "
                             + (", ".join(sorted(kinds)) or "none"))
        q, s = f"{value} fully hidden", hidden(paths, value)
    elif key == "rank" and value.strip().lstrip("-").isdigit():
        if ranks is not None and int(value) not in ranks:
            raise ValueError(f"--what-if {question!r}: the traces have no rank {int(value)}; their ranks: "
                             + ", ".join(map(str, sorted(ranks))))
        q, s = f"rank {int(value)} as fast as the median of the others", rank_at_median(paths, int(value))
    elif key in ("launch-gaps", "no-launch-gaps"):
        q, s = "host launch gaps removed", launch_gaps(paths)
    else:
        raise ValueError(f"--what-if {question!r}: expected hide=KIND, rank=K, launch-gaps, or (with --config) "
                         f"overlap=MODE / overlap.ENGINE=MODE")
    base = measured_ms(paths)
    return dict(question=q, saving_ms=s, step_ms=base - s, measured_ms=base)
