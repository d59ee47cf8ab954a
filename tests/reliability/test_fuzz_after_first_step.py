"""Fuzz: one rank's model changes after the first step; every engine errs on every rank or is right.

For each engine (TP layers, DataParallel, ShardedOptimizer, fully_shard, MoE, ring attention,
the pipeline) and each change (dtype, autocast, a width, a new parameter, requires_grad), made on
one rank after one step of the same job everywhere, the next step must either raise on every
rank, or return on every rank the numbers one process computes for the same job with the same
change (a change such as one frozen weight that the job still means something with): never a
silent wrong number, and never a wait past the group's timeout. Hypothesis picks, for every
pair, the rank that changes and the engine's knob (overlap mode, prefetch depth, chunks,
schedule). One world of 2 gloo ranks; each example on its own group with a 3 s timeout.
"""

from __future__ import annotations

import datetime
import faulthandler
import functools
import time

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from distributed import distributed
from fuzz_cases import CASES, KINDS, KNOBS, rel

TIMEOUT_S = 3.0
MARGIN_S = 4.0
"""Past the timeout, what a rank may take to fail: the store round trips, the reports, two busy cores."""


def _examples() -> list[tuple[str, str, object, int]]:
    """(engine, change, knob, rank that changes) for every engine and change, knob and rank drawn by hypothesis."""
    pairs = [(e, k) for e in sorted(CASES) for k in KINDS]
    drawn = []

    @settings(max_examples=5, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(st.tuples(*[st.tuples(st.sampled_from(KNOBS[e]), st.sampled_from([0, 1])) for e, _ in pairs]))
    def collect(choices):
        drawn.append(choices)

    collect()
    return [(e, k, knob, who) for (e, k), (knob, who) in zip(pairs, drawn[-1])]


def _one(engine: str, kind: str, knob, who: int) -> dict:
    rank = dist.get_rank()
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        case = CASES[engine](group, knob)
        case.step()  # the first step: the same job on every rank
    except Exception as e:  # noqa: BLE001 - a case that cannot even start is the test's bug: say so
        return {"outcome": "the first step failed", "text": f"{type(e).__name__}: {str(e)[:300]}", "took": 0.0}
    t0 = time.monotonic()
    try:
        if rank == who:
            case.perturb(kind)
        got = case.step()
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        return {"outcome": "raised", "text": f"{type(e).__name__}: {str(e)[:300]}", "took": time.monotonic() - t0}
    took = time.monotonic() - t0
    want = case.expected(kind, who)
    if want is None:
        return {"outcome": "returned, but no single process computes this job", "took": took}
    unexpected = sorted(set(got) - set(want))
    err = max(rel(got[k], want[k]) for k in got if k in want)
    return {"outcome": "returned", "err": err, "tol": case.tol, "unexpected": unexpected, "took": took}


@distributed(world_size=2, timeout_s=60)
def _fuzz(examples):
    out = []
    for example in examples:
        # A hang past every timeout ends this process (and the test) with a traceback, not a stuck CI.
        faulthandler.dump_traceback_later(4 * TIMEOUT_S + 30, exit=True)
        out.append(_one(*example))
        faulthandler.cancel_dump_traceback_later()
        dist.barrier()  # on the world: the example's group may be broken, the world is not
    return out


@functools.cache
def _results():
    examples = _examples()
    return examples, _fuzz(examples)


def test_every_engine_and_change_is_drawn():
    examples, _ = _results()
    assert {(e, k) for e, k, _, _ in examples} == {(e, k) for e in CASES for k in KINDS}


@pytest.mark.parametrize("engine", sorted(CASES))
def test_a_change_on_one_rank_errs_everywhere_or_is_right(engine):
    examples, per_rank = _results()
    for i, (e, kind, knob, who) in enumerate(examples):
        if e != engine:
            continue
        a, b = per_rank[0][i], per_rank[1][i]
        where = f"{engine}, {kind} on rank {who}, knob {knob!r}: rank 0 {a}, rank 1 {b}"
        assert a["outcome"] == b["outcome"] and a["outcome"] in ("raised", "returned"), where
        if a["outcome"] == "returned":
            assert max(a["err"], b["err"]) <= a["tol"] and not a["unexpected"] + b["unexpected"], where
        assert max(a["took"], b["took"]) < TIMEOUT_S + MARGIN_S, where
