"""benchmarks/_lib/deepspeed_pipe.py: DeepSpeed's TrainSchedule replayed: its step order, and what its paired blocking sends cost."""

import sys
from pathlib import Path

import pytest

from overlapkit.costmodel import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # benchmarks/_lib/deepspeed_pipe.py
from _lib.deepspeed_pipe import instructions, makespan_ms, steps  # noqa: E402

# The PP4 / 6 micro-batch table of DeepSpeed's own TrainSchedule docstring (IF/IB: idle steps).
DEEPSPEED_PP4_MB6 = (
    "F0 IB F1 IB F2 IB F3 B0 F4 B1 F5 B2 IF B3 IF B4 IF B5",
    "IB F0 IB F1 IB F2 B0 F3 B1 F4 B2 F5 B3 IF B4 IF B5 IF",
    "IF IB F0 IB F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 IF B5 IF IB",
    "IB IF IB F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 IF IB IF",
)


def _row(m, p, s):
    return " ".join((("F" if f else "B") + str(j)) if j is not None else ("IF" if f else "IB")
                    for f, j in steps(m, p, s))


def test_steps_are_deepspeeds_table():
    assert tuple(_row(6, 4, s) for s in range(4)) == DEEPSPEED_PP4_MB6


def test_every_send_has_its_receive_and_results_go_out_a_step_later():
    m, p = 5, 3
    progs = [instructions(m, p, s) for s in range(p)]
    sends = {(s, peer, what) for s in range(p) for op, peer, what in progs[s] if op == "send"}
    recvs = {(peer, s, what) for s in range(p) for op, peer, what in progs[s] if op == "recv"}
    assert sends == recvs and len(sends) == 2 * m * (p - 1)
    # stage 0 sends micro-batch 0's activation only after it received nothing: in its step-1 slot
    first = progs[0][:2]
    assert first == [("F", None, 0), ("send", 1, ("act", 0))]


def test_makespan_is_1f1b_without_transfers_and_the_slowest_stage_sets_the_pace():
    assert makespan_ms(6, [1.0] * 4, [2.0] * 4) == pytest.approx(9 * 3.0)  # (m + p - 1)(f + b)
    # a slower last stage: m of its micro-batches plus the other stages' fill and drain once
    assert makespan_ms(8, [1.0, 1.0, 1.0, 1.5], [2.0, 2.0, 2.0, 3.0]) == pytest.approx(8 * 4.5 + 3 * 3.0)


def test_unbatched_blocking_transfers_cost_more_than_one_hop_per_step():
    """A step sends the previous result, then receives the current input, one after the other: more
    than the one transfer per step a batched send+receive (Megatron's 1F1B) leaves on the path, at
    most two."""
    m, p, t = 8, 4, 0.1
    free = makespan_ms(m, [1.0] * p, [2.0] * p)
    paid = makespan_ms(m, [1.0] * p, [2.0] * p, p2p_ms=t)
    assert free + 2 * (m + p - 1) * t < paid <= free + 4 * (m + p - 1) * t + 1e-9


def test_bad_inputs_name_the_field():
    with pytest.raises(ConfigError, match="one time per stage"):
        makespan_ms(4, [1.0, 1.0], [2.0])
    with pytest.raises(ConfigError, match="micro_batches"):
        makespan_ms(0, [1.0], [2.0])
