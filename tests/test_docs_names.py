"""Every `overlapkit.x.y` the README and docs/ name in backticks exists: a renamed or removed function is
caught here, not by a reader."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from overlapkit.runtime.spans import COMM_RANGE_PREFIX, COMPUTE_RANGE_PREFIX, WAIT_RANGE

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
NAME = re.compile(r"`(overlapkit(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
RANGES = (COMM_RANGE_PREFIX, COMPUTE_RANGE_PREFIX, WAIT_RANGE)
"""Profiler range names (`overlapkit.comm.<kind>`): labels in a trace, not Python names."""


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def test_every_backticked_overlapkit_name_in_the_docs_exists():
    missing = []
    for doc in (d for d in DOCS if d.exists()):
        for i, line in enumerate(doc.read_text().splitlines(), 1):
            for dotted in NAME.findall(line):
                if (dotted + ".").startswith(RANGES) or dotted == WAIT_RANGE:
                    continue
                if not _resolves(dotted):
                    missing.append(f"{doc.relative_to(ROOT)}:{i}: {dotted}")
    assert not missing, "names in the docs that overlapkit does not have:\n" + "\n".join(missing)


def test_the_check_sees_a_missing_name():
    assert _resolves("overlapkit.timeline.record") and _resolves("overlapkit.tensor_parallel.tp_mesh")
    assert not _resolves("overlapkit.timeline.no_such_function") and not _resolves("overlapkit.no_such_module")
