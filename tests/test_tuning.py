"""MeasuredChoice: candidates timed on the first calls, the fastest kept, nothing timed afterwards (one process)."""

import pytest

from overlapkit.runtime import tuning
from overlapkit.runtime.tuning import MeasuredChoice


@pytest.fixture
def clock(monkeypatch):
    """A fake clock the test advances by hand: stamps are its current value, durations their difference."""
    now = [0.0]
    monkeypatch.setattr(tuning, "_stamp", lambda device: now[0])
    monkeypatch.setattr(tuning, "_ms", lambda a, b: b - a)
    return now


def _run(choice: MeasuredChoice, clock, fwd: dict, bwd: dict | None) -> list:
    """Make calls until the choice is decided; return the candidates the calls ran, in order."""
    ran = []
    while True:
        trial = choice.trial("cpu")
        if trial is None:
            return ran
        ran.append(trial.choice)
        with trial.forward():
            clock[0] += fwd[trial.choice]
        if bwd is not None:
            with trial.backward():
                clock[0] += bwd[trial.choice]


def test_fastest_forward_plus_backward_is_kept_after_rotated_rounds(clock):
    choice = MeasuredChoice([1, 2, 4], None, what="t", kind="ep_dispatch", rounds=3, warmup_rounds=1)
    ran = _run(choice, clock, {1: 10.0, 2: 4.0, 4: 3.0}, {1: 10.0, 2: 4.0, 4: 6.0})
    # One warm-up round and three timed ones, each round in the next rotated order.
    assert ran == [1, 2, 4, 2, 4, 1, 4, 1, 2, 1, 2, 4]
    assert choice.decided == 2  # 8 ms fwd+bwd; 4 is faster forward only (3 ms) but 9 ms in all
    assert choice.measured == {1: 20.0, 2: 8.0, 4: 9.0}
    assert "forward+backward" in choice.reason and "2: 8 ms" in choice.reason


def test_forward_only_calls_are_judged_by_forward(clock):
    choice = MeasuredChoice(["pipelined", "none"], None, what="t", kind="cp_kv", rounds=2)
    _run(choice, clock, {"pipelined": 5.0, "none": 7.0}, None)
    assert choice.decided == "pipelined" and "measured forward (" in choice.reason


def test_a_tie_keeps_the_first_candidate(clock):
    choice = MeasuredChoice([1, 2], None, what="t", kind="ep_dispatch", rounds=2, tie=0.01)
    _run(choice, clock, {1: 10.0, 2: 9.95}, {1: 0.0, 2: 0.0})  # 0.5 % apart: within the tie
    assert choice.decided == 1


def test_nothing_is_timed_once_decided(clock, monkeypatch):
    choice = MeasuredChoice([1, 2], None, what="t", kind="ep_dispatch", rounds=1)
    _run(choice, clock, {1: 1.0, 2: 2.0}, {1: 1.0, 2: 1.0})
    assert choice.decided == 1

    def no_clock(*_):
        raise AssertionError("a clock was read after the decision")
    monkeypatch.setattr(tuning, "_stamp", no_clock)
    for _ in range(3):
        assert choice.trial("cpu") is None


def test_single_candidate_and_decide_now_need_no_trials(clock):
    assert MeasuredChoice([3], None, what="t", kind="ep_dispatch").trial("cpu") is None
    choice = MeasuredChoice([1, 2], None, what="t", kind="ep_dispatch")
    choice.decide_now(1, "one rank")
    assert choice.trial("cpu") is None and choice.decided == 1 and choice.reason == "one rank"
    with pytest.raises(ValueError, match="at least one candidate"):
        MeasuredChoice([], None, what="t", kind="ep_dispatch")


def _run_rounds(choice: MeasuredChoice, clock, ms) -> list:
    """Like _run, with ms(call index, candidate) the forward+backward time of each call."""
    ran = []
    while (trial := choice.trial("cpu")) is not None:
        with trial.forward():
            clock[0] += ms(len(ran), trial.choice)
        with trial.backward():
            pass
        ran.append(trial.choice)
    return ran


def test_paired_keeps_the_first_unless_another_wins_most_rounds(clock):
    # Round r (after the warm-up round) slows every call of it alike: only per-round ratios see through that.
    load = [0.0, 0.0, 50.0, 100.0, 150.0]  # ms added to every call of round r (round 0 is the warm-up)
    faster = lambda i, c: load[i // 2] + (97.0 if c == "b" else 100.0)  # noqa: E731 - b 3 % faster in every round
    choice = MeasuredChoice(["a", "b"], None, what="t", kind="dp_all_reduce", rounds=4, paired=True)
    assert _run_rounds(choice, clock, faster) == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b"]
    assert choice.decided == "b" and "b faster in at least 3 rounds in 4" in choice.reason
    assert choice.measured == {"a": 175.0, "b": 172.0}
    # b far faster in one round and slower in the other three: its median ratio is above 1 - tie.
    spiky = lambda i, c: 100.0 if c == "a" else (40.0 if i // 2 == 1 else 102.0)  # noqa: E731
    choice = MeasuredChoice(["a", "b"], None, what="t", kind="dp_all_reduce", rounds=4, paired=True)
    _run_rounds(choice, clock, spiky)
    assert choice.decided == "a" and "a kept" in choice.reason
    # b faster in half the rounds (by 10 %): not three in four, so the first stays.
    half = lambda i, c: 100.0 if c == "a" else (90.0 if i // 2 in (1, 2) else 101.0)  # noqa: E731
    choice = MeasuredChoice(["a", "b"], None, what="t", kind="dp_all_reduce", rounds=4, paired=True)
    _run_rounds(choice, clock, half)
    assert choice.decided == "a"


def test_paired_picks_the_lowest_median_ratio_among_those_that_win(clock):
    ms = {"a": 100.0, "b": 95.0, "c": 90.0}
    choice = MeasuredChoice(["a", "b", "c"], None, what="t", kind="dp_all_reduce", rounds=3, paired=True)
    _run_rounds(choice, clock, lambda i, c: ms[c])
    assert choice.decided == "c"
    # Within the tie (0.5 % faster in every round): the first is kept.
    choice = MeasuredChoice(["a", "b"], None, what="t", kind="dp_all_reduce", rounds=3, paired=True, tie=0.01)
    _run_rounds(choice, clock, lambda i, c: 100.0 if c == "a" else 99.5)
    assert choice.decided == "a"


def test_paired_judges_each_phase_apart(clock):
    # b's forward is 5 % faster and its backward 5 % slower than a's: by total a tie, by pass one each.
    fwd, bwd = {"a": 100.0, "b": 95.0}, {"a": 100.0, "b": 105.0}
    choice = MeasuredChoice(["a", "b"], None, what="t", kind="dp_all_reduce", rounds=4, paired=True)
    _run(choice, clock, fwd, bwd)
    assert choice.decided == "a" and choice.per_phase == {"forward": "b", "backward": "a"}


def test_a_phase_of_several_passes_is_their_sum(clock):
    choice = MeasuredChoice(["a", "b"], None, what="t", kind="dp_all_reduce", rounds=2, paired=True)
    while (trial := choice.trial("cpu")) is not None:
        for _ in range(3 if trial.choice == "a" else 1):  # a: three forwards of 10 ms; b: one of 20 ms
            with trial.forward():
                clock[0] += 10.0 if trial.choice == "a" else 20.0
    assert choice.measured == {"a": 30.0, "b": 20.0} and choice.decided == "b" and choice.per_phase is None
