"""Draw which communication ran beside computation: one lane per (rank, stream), exposed time in red.

`plot_spans` draws measured spans: compute and communication bars on the lanes where they
ran, coloured by kind, and under each rank a lane with the communication no compute covered.
Given critical paths (timeline/critical_path.py), a top lane shows the path coloured by why,
and each rank gets a lane with the stretches the path spent on it. `write_chrome_trace` writes the same spans
as a Chrome trace that opens in Perfetto or chrome://tracing.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..runtime import intervals as iv
from ..runtime.spans import COMPUTE, Span

COMPUTE_COLOR = "#4c72b0"
EXPOSED_COLOR = "#d62728"
OTHER_COLORS = {"memcpy": "#bbbbbb", "memset": "#dddddd", "pp_bubble": "#f0e442"}
WHY_COLORS = {"compute": COMPUTE_COLOR, "exposed comm": EXPOSED_COLOR, "waiting for rank": "#ff9896",
              "host launch gap": "#8c564b", "copy": "#bbbbbb", "idle": "#dddddd"}
PATH_COLOR = "#111111"
_COMM_PALETTE = ["#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
                 "#7f7f7f", "#ffbb78", "#98df8a"]


def _colors(spans: list[Span]) -> dict[str, str]:
    kinds = sorted({s.kind for s in spans if s.is_comm})
    colors = {k: _COMM_PALETTE[i % len(_COMM_PALETTE)] for i, k in enumerate(kinds)}
    colors.update(OTHER_COLORS, **{COMPUTE: COMPUTE_COLOR})
    return colors


def _stream_order(stream: str) -> tuple:
    """Lanes with compute first, then by name with numbers in numeric order."""
    return (stream != "compute", tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in stream.split()))


def _why_color(why: str) -> str:
    return WHY_COLORS.get("waiting for rank" if why.startswith("waiting for rank") else why, "#999999")


def plot_groups(groups: dict[str, list[Span]], path: str | Path, title: str | None = None,
                critical=None) -> Path:
    """Draw each group (a rank, or a trace) as its lanes plus an 'exposed comm' lane; returns the path.

    `critical`: critical paths to draw (a lane per group with the path's stretches on its rank, and a
    top lane with the whole path coloured by why)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    everything = [s for ss in groups.values() for s in ss]
    colors = _colors(everything)
    lanes: list[tuple[str, list[tuple[float, float]], str, float]] = []  # label, bars, color, height
    segments = [seg for p in (critical or []) for seg in p.segments]
    if segments:
        for why in sorted({_why_color(x.why) for x in segments}):
            bars = [(x.start_ms, x.ms) for x in segments if _why_color(x.why) == why]
            lanes.append(("critical path (all ranks) · by why", bars, why, 0.8))
    for label, spans in groups.items():
        if segments and spans:
            mine = [(x.start_ms, x.ms) for x in segments if x.rank == spans[0].rank]
            if mine:
                lanes.append((f"{label} · on the critical path", mine, PATH_COLOR, 0.35))
        compute = iv.union((s.start_ms, s.end_ms) for s in spans if s.is_compute)
        comm = iv.union((s.start_ms, s.end_ms) for s in spans if s.is_comm)
        for stream in sorted({s.stream for s in spans}, key=_stream_order):
            on = [s for s in spans if s.stream == stream]
            for kind in sorted({s.kind for s in on}, key=lambda k: (k != COMPUTE, k)):
                bars = [(s.start_ms, s.end_ms - s.start_ms) for s in on if s.kind == kind]
                lanes.append((f"{label} · {stream}", bars, colors[kind], 0.8))
        exposed = iv.subtract(comm, compute)
        lanes.append((f"{label} · exposed comm {iv.length(exposed):.1f} of {iv.length(comm):.1f} ms",
                      [(a, b - a) for a, b in exposed], EXPOSED_COLOR, 0.5))

    labels = list(dict.fromkeys(l for l, _, _, _ in lanes))
    y_of = {l: len(labels) - 1 - i for i, l in enumerate(labels)}
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.45 * len(labels)))
    for label, bars, color, height in lanes:
        # Thin bars of many spans still show: draw edges in the bar colour.
        ax.broken_barh(bars, (y_of[label] - height / 2, height), facecolors=color, edgecolors=color,
                       linewidth=0.3)
    for label in labels[:-1]:
        if "exposed comm" in label:  # a rule under each group's exposed lane separates the groups
            ax.axhline(y_of[label] - 0.5, color="black", linewidth=0.6)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels([labels[len(labels) - 1 - y] for y in range(len(labels))], fontsize=8)
    ax.set_xlabel("time (ms)")
    lo, hi = min((s.start_ms for s in everything), default=0.0), max((s.end_ms for s in everything), default=0.0)
    if hi > lo:
        ax.set_xlim(lo, hi)
    ax.grid(axis="x", alpha=0.3)
    shown = {s.kind for s in everything}
    handles = [Patch(color=c, label=k) for k, c in colors.items() if k in shown]
    handles.append(Patch(color=EXPOSED_COLOR, label="exposed communication (not covered by compute)"))
    if segments:
        handles.append(Patch(color=PATH_COLOR, label="on the critical path"))
        shown_why = {("waiting for rank" if x.why.startswith("waiting for rank") else x.why) for x in segments}
        handles += [Patch(color=c, label=f"path: {w}") for w, c in WHY_COLORS.items() if w in shown_why]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    ax.set_title(title or "Communication and compute timeline", fontsize=11)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_spans(spans: list[Span], path: str | Path, title: str | None = None) -> Path:
    """Draw recorded or traced spans: lanes per (rank, stream), colours per kind, exposed time in red."""
    groups: dict[str, list[Span]] = {}
    for s in sorted(spans, key=lambda s: s.rank):
        groups.setdefault(f"rank {s.rank}", []).append(s)
    return plot_groups(groups, path, title)


def write_chrome_trace(spans: list[Span], path: str | Path) -> Path:
    """Write spans as a Chrome trace (Perfetto, chrome://tracing): a process per rank, a thread per stream.

    Each rank also gets an 'exposed comm' thread with the communication no compute covered.
    """
    events: list[dict] = []
    by_rank: dict[int, list[Span]] = {}
    for s in spans:
        by_rank.setdefault(s.rank, []).append(s)
    for rank, ss in sorted(by_rank.items()):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        streams = sorted({s.stream for s in ss}, key=_stream_order) + ["exposed comm"]
        tid = {name: i for i, name in enumerate(streams)}
        for name, i in tid.items():
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": i, "args": {"name": name}})
        for s in ss:
            events.append({"ph": "X", "name": s.name or s.kind, "cat": s.kind, "pid": rank, "tid": tid[s.stream],
                           "ts": s.start_ms * 1e3, "dur": s.duration_ms * 1e3,
                           "args": {"kind": s.kind, "bytes": s.nbytes, "group_size": s.group_size,
                                    "step": s.step}})
        compute = iv.union((s.start_ms, s.end_ms) for s in ss if s.is_compute)
        comm = iv.union((s.start_ms, s.end_ms) for s in ss if s.is_comm)
        for a, b in iv.subtract(comm, compute):
            events.append({"ph": "X", "name": "exposed", "cat": "exposed", "pid": rank,
                           "tid": tid["exposed comm"], "ts": a * 1e3, "dur": (b - a) * 1e3})
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path
