"""Per-round ratios between variants timed side by side, and the verdict a target reads from them.

A round runs every variant once (in a balanced order), so the ratio of two variants in the same round
cancels the load that came and went; the median of those ratios is the comparison, and its middle
half (p25-p75) says whether a miss is noise (it straddles the target) or systematic.
"""

from __future__ import annotations

import statistics


def per_round(a: list[float], b: list[float]) -> dict | None:
    """{median, iqr: [p25, p75], rounds} of a[i] / b[i]; None when either did not run."""
    ratios = sorted(x / y for x, y in zip(a, b) if y > 0)
    if not ratios:
        return None
    n = len(ratios)
    return dict(median=statistics.median(ratios), iqr=[ratios[n // 4], ratios[(3 * n) // 4 if n > 1 else 0]],
                rounds=n)


def verdict(r: dict | None, target: float) -> str:
    """met (median <= target), within noise (a miss whose middle half straddles the target), or MISSED."""
    if r is None:
        return "not run"
    if r["median"] <= target:
        return "met"
    return "within noise" if r["iqr"][0] <= target <= r["iqr"][1] else "MISSED"


def text(r: dict | None) -> str:
    if r is None:
        return "—"
    return f"{r['median']:.3f} ({r['iqr'][0]:.3f}–{r['iqr'][1]:.3f})"
