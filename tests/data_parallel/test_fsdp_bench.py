"""benchmarks/fsdp_overlap.py's fairness and labels (issue 17): a balanced order of variants, and
a gap between identical configurations called noise only when its middle half straddles 1."""

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))  # the script imports its sibling _common
    try:
        spec = importlib.util.spec_from_file_location("fsdp_overlap", BENCH / "fsdp_overlap.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


@pytest.mark.parametrize("n", [2, 3, 5, 7, 8])
def test_every_variant_follows_every_other_equally_often(bench, n):
    rows = bench.balanced_orders(n)
    assert len(rows) == (n if n % 2 == 0 else 2 * n)
    assert all(sorted(r) == list(range(n)) for r in rows), rows
    follows = Counter((r[i], r[i + 1]) for r in rows for i in range(n - 1))
    assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1, follows
    positions = Counter((v, i) for r in rows for i, v in enumerate(r))
    assert len(positions) == n * n and len(set(positions.values())) == 1, positions


def test_a_rotation_is_what_it_replaces(bench):
    # Why: a rotation of 7 variants keeps each one's predecessor (auto always ran after prefetch=2).
    n = 7
    rotation = [[(v + r) % n for v in range(n)] for r in range(n)]
    assert len({(r[i], r[i + 1]) for r in rotation for i in range(n - 1)}) == n  # one predecessor each
    assert len({(r[i], r[i + 1]) for r in bench.balanced_orders(n) for i in range(n - 1)}) == n * (n - 1)


def test_time_balanced_runs_each_variant_once_a_round_in_the_design_order(bench, monkeypatch):
    import torch

    monkeypatch.setitem(bench.time_variants.__globals__, "line_up", lambda device: None)  # no group here
    ran = []
    times = bench.time_balanced(ran.append, ["a", "b", "c"], 4, torch.device("cpu"))
    assert {k: len(v) for k, v in times.items()} == {"a": 4, "b": 4, "c": 4}
    orders = bench.balanced_orders(3)
    assert ran == [["a", "b", "c"][j] for i in range(4) for j in orders[i]]


def test_labels_say_noise_only_when_the_middle_half_straddles_1(bench):
    gap = dict(of=bench.AUTO, to="overlapkit prefetch=2", median=1.044, iqr=[1.021, 1.071])  # 16 cores, issue 17
    assert bench.verdict(gap) == "MISSED"
    assert bench.same_config(gap).startswith("a systematic gap, not noise: slower")
    noise = dict(gap, median=1.02, iqr=[0.98, 1.06])
    assert bench.verdict(noise) == "within noise" and bench.same_config(noise).startswith("within noise")
    faster = dict(gap, median=0.95, iqr=[0.93, 0.97])
    assert bench.verdict(faster) == "met" and "faster" in bench.same_config(faster)


def test_each_target_is_judged_at_its_own_limit(bench):
    r = dict(of=bench.AUTO, to="FSDP2 defaults", median=0.93, iqr=[0.89, 0.99])  # 16 cores, 8 ranks
    assert bench.verdict(r, bench.TARGETS["fsdp2"]) == "within noise"  # <= 0.9x: the middle half holds 0.9
    assert bench.verdict(dict(r, iqr=[0.91, 0.99]), bench.TARGETS["fsdp2"]) == "MISSED"
    assert bench.verdict(dict(r, median=1.008, iqr=[0.98, 1.03]), bench.TARGETS["best fixed"]) == "met"
