"""Interval arithmetic: the sets every overlap number is a length of."""

from hypothesis import given, settings
from hypothesis import strategies as st

from overlapkit.runtime import intervals as iv


def test_union_merges_nested_touching_and_overlapping():
    assert iv.union([(0, 10), (2, 3)]) == [(0, 10)]  # nested
    assert iv.union([(0, 2), (2, 5)]) == [(0, 5)]  # touching: one interval, no double count
    assert iv.union([(4, 6), (0, 3), (2, 5)]) == [(0, 6)]  # unsorted, overlapping
    assert iv.union([(0, 1), (3, 4)]) == [(0, 1), (3, 4)]  # apart
    assert iv.union([(1, 1), (2, 1)]) == []  # empty and reversed spans cover nothing


def test_intersect_and_subtract_known_answers():
    comm = iv.union([(0, 4), (6, 10)])
    compute = iv.union([(2, 7)])
    assert iv.intersect(comm, compute) == [(2, 4), (6, 7)]
    assert iv.subtract(comm, compute) == [(0, 2), (7, 10)]
    assert iv.subtract(compute, comm) == [(4, 6)]
    assert iv.length(iv.intersect(comm, compute)) == 3
    # touching sets share no time
    assert iv.intersect([(0, 2)], [(2, 4)]) == []
    assert iv.subtract([(0, 2)], [(2, 4)]) == [(0, 2)]
    # a hole punched in the middle, and a cover that removes everything
    assert iv.subtract([(0, 10)], [(3, 4), (5, 6)]) == [(0, 3), (4, 5), (6, 10)]
    assert iv.subtract([(1, 2), (3, 4)], [(0, 5)]) == []
    assert iv.clip([(0, 10)], 8, 20) == [(8, 10)]
    assert iv.clip([(0, 10)], 5, 5) == []


pairs = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=8)


def _cells(pairs_):
    return {t for a, b in pairs_ for t in range(a, b)}


@settings(max_examples=200, deadline=None)
@given(pairs, pairs)
def test_operations_match_unit_cells(a, b):
    # On an integer grid a set is the unit cells [t, t+1) it covers: count them by brute force.
    ua, ub = iv.union(a), iv.union(b)
    assert all(x[1] < y[0] for x, y in zip(ua, ua[1:]))  # disjoint, sorted, never touching
    assert iv.length(ua) == len(_cells(a))
    assert iv.length(iv.intersect(ua, ub)) == len(_cells(a) & _cells(b))
    assert iv.length(iv.subtract(ua, ub)) == len(_cells(a) - _cells(b))
    assert _cells(iv.subtract(ua, ub)) == _cells(a) - _cells(b)
