"""Interval arithmetic for deciding which communication ran while computation ran.

Every number in the report is a length of a set of time: the union of the compute spans,
the union of the communication spans, their intersection (hidden communication) and the
difference (exposed communication). A set is a sorted list of disjoint `(start, end)` pairs;
intervals that touch are merged, so a set never counts the same instant twice.
"""

from __future__ import annotations

from typing import Iterable

Intervals = list[tuple[float, float]]


def union(pairs: Iterable[tuple[float, float]]) -> Intervals:
    """The set covered by any of `pairs`, as sorted disjoint intervals (empty pairs dropped)."""
    out: Intervals = []
    for start, end in sorted(p for p in pairs if p[1] > p[0]):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def length(a: Intervals) -> float:
    """Total time covered by a set."""
    return sum(end - start for start, end in a)


def intersect(a: Intervals, b: Intervals) -> Intervals:
    """Time covered by both sets."""
    out: Intervals = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """Time covered by `a` and not by `b`."""
    out: Intervals = []
    j = 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, cur = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


def clip(a: Intervals, start: float, end: float) -> Intervals:
    """The part of a set inside [start, end]."""
    return intersect(a, [(start, end)]) if end > start else []
