"""The turns of MoE decode's two micro-batches (expert_parallel/two_batch.py), one process, no transfers.

Exactly one micro-batch runs at a time and the turn passes at `switch()`, so the order of their steps is
fixed (the order every rank issues its collectives in); B runs on the shared worker thread, under no_grad
like A; a failure in B is raised in A, a failure in A unwinds B; and B need not run at all.
"""

import threading

import pytest
import torch

from overlapkit.expert_parallel.two_batch import MicroBatchAborted, MicroBatchWorker, TwoBatch, split_sequences


def _run(second_body, first_body, needed=True):
    worker = MicroBatchWorker()
    log = []
    turns = TwoBatch(lambda: second_body(turns, log), 1, worker)
    turns.needed = needed
    with torch.no_grad():
        first = first_body(turns, log)
        second = turns.finish()
    return log, first, second


def _a(turns, log):
    log.append(("A", "dispatch", turns.index()))
    turns.switch()
    log.append(("A", "experts"))
    turns.switch()
    log.append(("A", "sum"))
    return "a"


def _b(turns, log):
    log.append(("B", "dispatch", turns.index(), torch.is_grad_enabled(), threading.current_thread().name))
    turns.switch()
    log.append(("B", "experts"))
    turns.switch()
    log.append(("B", "sum"))
    return "b"


def test_turns_fix_the_order_and_b_runs_on_the_worker_without_grad():
    log, first, second = _run(_b, _a)
    assert (first, second) == ("a", "b")
    assert log == [("A", "dispatch", 0), ("B", "dispatch", 1, False, "overlapkit-micro-batch-b"), ("A", "experts"),
                   ("B", "experts"), ("A", "sum"), ("B", "sum")]


def test_b_need_not_run():
    log, first, second = _run(_b, _a, needed=False)
    assert (first, second) == ("a", None) and [x[0] for x in log] == ["A", "A", "A"]


def test_a_failure_in_b_is_raised_in_a():
    def bad_b(turns, log):
        raise ValueError("B broke")

    with pytest.raises(ValueError, match="B broke"):
        _run(bad_b, _a)


def test_a_failure_in_a_unwinds_b():
    worker = MicroBatchWorker()
    seen = []

    def b():
        try:
            turns.switch()
        except MicroBatchAborted as e:
            seen.append(str(e))
            raise

    turns = TwoBatch(b, 1, worker)
    turns.needed = True
    turns.switch()  # B runs until its first switch, hands the turn back
    turns.abort()   # A failed here: B wakes, raises, and A has waited for it
    assert seen == ["the other micro-batch of this MoE block failed"]
    assert _run(_b, _a)[1:] == ("a", "b")  # a fresh pair of turns works on a new worker afterwards


def test_split_sequences():
    assert [split_sequences(b) for b in (1, 2, 3, 4, 7)] == [1, 1, 2, 2, 4]
