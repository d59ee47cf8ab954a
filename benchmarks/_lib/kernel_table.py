"""GPU kernel time by name in one profiler trace: where a step's compute goes, kernel by kernel, so that a
per-step cost the cost model does not price can be named from a run instead of estimated from its code."""

from __future__ import annotations

import json
from pathlib import Path


def kernel_table(path: str | Path, steps: int, top: int = 40) -> list[list]:
    """[[kernel name (its first 200 characters: the functor, not the argument list), ms a step, launches a
    step], ...] of the `top` kernels by time in the Chrome trace at `path`, which holds `steps` steps."""
    events = json.loads(Path(path).read_text()).get("traceEvents", [])
    by: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            name = e.get("name", "?")[:200]
            t = by.setdefault(name, [0.0, 0])
            t[0] += e.get("dur", 0.0) / 1e3
            t[1] += 1
    rows = sorted(by.items(), key=lambda kv: -kv[1][0])[:top]
    return [[name, ms / steps, n / steps] for name, (ms, n) in rows]
