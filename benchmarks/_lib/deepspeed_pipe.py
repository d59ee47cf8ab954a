"""DeepSpeed's pipeline `TrainSchedule`, priced: neighbouring stages' micro-batch compute overlapping
under its step-paired, blocking sends, against the 1F1B the step model assumes.

DeepSpeed's PipelineEngine (deepspeed/runtime/pipe/schedule.py, the stack MT-NLG trained on) runs
2·(m + p − 1) steps per batch: even stages forward on even steps and backward on odd ones, odd
stages the other way round, a step with no valid micro-batch idles. A result is sent at the start
of the sender's NEXT step (a forward step first sends the previous backward's gradient, then
receives its input; a backward step first receives its output gradient, then sends the previous
forward's activation), and a send completes only when the receiver takes it. The two transfers
of a step run one after the other (Megatron's 1F1B batches them), so up to two transfer times per
step sit on the critical path. `makespan_ms` replays that instruction stream as an event graph,
so the cost of the pairing is seen rather than assumed.
"""

from __future__ import annotations

import math

from overlapkit.costmodel import ConfigError


def steps(micro_batches: int, stages: int, stage: int) -> list[tuple[bool, int | None]]:
    """Stage `stage`'s (is_forward, micro-batch or None when idle) for each of the 2(m+p−1) steps
    (TrainSchedule._step_to_micro_batch)."""
    out = []
    for k in range(2 * (micro_batches + stages - 1)):
        forward = (k % 2 == 0) == (stage % 2 == 0)
        base = k // 2 if k % 2 == 0 else (k - 1) // 2
        if forward:
            j = base - stage // 2
        elif k % 2 == 0:
            j = base - stages + (stage + 1) // 2
        else:
            j = base - stages + 1 + stage // 2
        out.append((forward, j if 0 <= j < micro_batches else None))
    return out


def instructions(micro_batches: int, stages: int, stage: int) -> list[tuple[str, int | None, int]]:
    """Stage `stage`'s instruction stream: ('send'|'recv', peer stage, (kind, micro-batch)) and
    ('F'|'B', None, micro-batch), in TrainSchedule.steps' order."""
    out, prev = [], None
    for forward, j in steps(micro_batches, stages, stage):
        if forward and stage > 0:  # SendGrad(prev), then RecvActivation(curr)
            if prev is not None:
                out.append(("send", stage - 1, ("grad", prev)))
            if j is not None:
                out.append(("recv", stage - 1, ("act", j)))
        elif not forward and stage < stages - 1:  # RecvGrad(curr), then SendActivation(prev)
            if j is not None:
                out.append(("recv", stage + 1, ("grad", j)))
            if prev is not None:
                out.append(("send", stage + 1, ("act", prev)))
        if j is not None:
            out.append(("F" if forward else "B", None, j))
        prev = j
    return out


def makespan_ms(micro_batches: int, fwd_ms: list[float], bwd_ms: list[float], p2p_ms: float = 0.0) -> float:
    """Time from the first forward to the last backward of one batch under TrainSchedule, with
    stage i's forward and backward of one micro-batch taking fwd_ms[i] and bwd_ms[i] and every
    transfer p2p_ms once both ends have reached it (a blocking send)."""
    stages = len(fwd_ms)
    if len(bwd_ms) != stages or stages < 1:
        raise ConfigError(f"fwd_ms and bwd_ms must give one time per stage (got {len(fwd_ms)} and {len(bwd_ms)})")
    if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) or micro_batches < 1:
        raise ConfigError(f"makespan_ms.micro_batches={micro_batches!r}: must be an integer >= 1")
    if not isinstance(p2p_ms, int | float) or not math.isfinite(p2p_ms) or p2p_ms < 0:
        raise ConfigError(f"makespan_ms.p2p_ms={p2p_ms!r}: must be a finite number >= 0")
    progs = [instructions(micro_batches, stages, s) for s in range(stages)]
    pos, clock = [0] * stages, [0.0] * stages
    waiting: dict[tuple, tuple[float, int]] = {}  # (sender, receiver, what) -> (arrival, stage that waits)
    done: dict[tuple, float] = {}  # transfers finished by the second end, for the first end to pick up
    active = list(range(stages))
    while active:
        blocked, moved = [], False
        for s in active:
            while pos[s] < len(progs[s]):
                op, peer, what = progs[s][pos[s]]
                if op in ("F", "B"):
                    clock[s] += fwd_ms[s] if op == "F" else bwd_ms[s]
                elif (key := (s, peer, what) if op == "send" else (peer, s, what)) in done:
                    clock[s] = done.pop(key)
                elif key not in waiting or waiting[key][1] == s:  # first here, or still waiting
                    moved |= key not in waiting
                    waiting.setdefault(key, (clock[s], s))
                    blocked.append(s)
                    break
                else:  # the second end completes the transfer
                    clock[s] = max(clock[s], waiting.pop(key)[0]) + p2p_ms
                    done[key] = clock[s]
                pos[s] += 1
                moved = True
        if blocked and not moved:
            raise AssertionError("TrainSchedule deadlocked: the instruction streams do not pair")
        active = blocked
    return max(clock)
