"""Named CPU time ranges per thread: which range was open on a thread when a transfer was issued.

The reader ties every kernel, copy and gloo transfer to the range open at its issue (an
overlapkit comm/compute range, a `record_param_comms` op, a phase marker), so finding the
innermost range holding a time stamp must be fast on traces with 10^5 ranges.
"""

from __future__ import annotations

import bisect


class Ranges:
    """Named time ranges per thread; finds the innermost one holding a time stamp.

    Ranges of one thread nest like a call stack, so the innermost range holding a time is the
    last one started before it, or the nearest enclosing range of that one.
    """

    def __init__(self) -> None:
        self._by_tid: dict[object, list[tuple[float, float, dict]]] = {}

    def add(self, tid, start: float, end: float, value: dict) -> None:
        self._by_tid.setdefault(tid, []).append((start, end, value))

    def rows(self):
        """Every range as (thread, start, end, value)."""
        return ((tid, a, b, x) for tid, rows in self._by_tid.items() for a, b, x in rows)

    def freeze(self) -> None:
        self._starts, self._parent = {}, {}
        for tid, rows in self._by_tid.items():
            rows.sort(key=lambda r: (r[0], -r[1]))
            parent, stack = [], []
            for i, (start, end, _) in enumerate(rows):
                while stack and rows[stack[-1]][1] < start:
                    stack.pop()
                parent.append(stack[-1] if stack else -1)
                stack.append(i)
            self._starts[tid], self._parent[tid] = [r[0] for r in rows], parent

    def find(self, tid, ts: float) -> dict | None:
        rows = self._by_tid.get(tid)
        if not rows:
            return None
        i = bisect.bisect_right(self._starts[tid], ts) - 1
        while i >= 0 and rows[i][1] < ts:
            i = self._parent[tid][i]
        return rows[i][2] if i >= 0 else None

    def enclosing(self, tid, ts: float) -> list[dict]:
        """Every range holding `ts` on thread `tid`, innermost first."""
        rows, out = self._by_tid.get(tid), []
        if not rows:
            return out
        i = bisect.bisect_right(self._starts[tid], ts) - 1
        while i >= 0:
            if rows[i][1] >= ts:
                out.append(rows[i][2])
            i = self._parent[tid][i]
        return out

    def find_any(self, ts: float, skip=()) -> dict | None:
        """The innermost range holding `ts` on any thread not in `skip` (the lowest thread id first)."""
        for tid in sorted(self._by_tid, key=str):
            if tid not in skip and (found := self.find(tid, ts)) is not None:
                return found
        return None

    def all(self) -> list[tuple[object, float, float, dict]]:
        return [(t, s, e, v) for t, rows in self._by_tid.items() for s, e, v in rows]

    def threads(self) -> set:
        return set(self._by_tid)
