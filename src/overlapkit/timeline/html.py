"""`overlapkit analyze DIR --html report.html`: one self-contained page to look at and pass around.

The page holds the timeline picture (with the critical path drawn on it) as an inline PNG, the
critical path and its what-ifs, the per-rank tables, the across-ranks and bandwidth tables and
the diagnosis — no file beside it, nothing fetched. A few lines of script sort a table by the
column clicked; the page reads fine without them.
"""

from __future__ import annotations

import base64
import html
import os
import tempfile
from pathlib import Path

_STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, Segoe UI, sans-serif; margin: 24px auto; max-width: 1400px;
       color: #222; padding: 0 16px; }
h1 { font-size: 22px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 8px 0 18px; font-size: 13px; }
th, td { padding: 3px 9px; border-bottom: 1px solid #eee; text-align: right; white-space: nowrap; }
th { background: #f4f4f6; cursor: pointer; user-select: none; }
th.l { text-align: left; }
td:first-child, th:first-child, td.l { text-align: left; }
caption { text-align: left; font-weight: 600; padding: 4px 0; }
.why-exposed { color: #b22; } .why-waiting { color: #c55; } .why-host { color: #8c564b; }
.check { margin: 10px 0; } .verdict { font-weight: 600; } .try { color: #1a5; }
img.timeline { max-width: 100%; border: 1px solid #ddd; }
.meta { color: #666; }
"""
_SCRIPT = """
document.querySelectorAll('table').forEach(function (table) {
  table.querySelectorAll('th').forEach(function (th, col) {
    th.addEventListener('click', function () {
      var body = table.tBodies[0], rows = Array.prototype.slice.call(body.rows);
      var down = th.dataset.down !== '1'; th.dataset.down = down ? '1' : '0';
      rows.sort(function (a, b) {
        var x = a.cells[col].textContent, y = b.cells[col].textContent, nx = parseFloat(x), ny = parseFloat(y);
        var c = (!isNaN(nx) && !isNaN(ny)) ? nx - ny : x.localeCompare(y);
        return down ? -c : c;
      });
      rows.forEach(function (r) { body.appendChild(r); });
    });
  });
});
document.body.dataset.ready = String(document.querySelectorAll('table').length);
"""


def _e(x) -> str:
    return html.escape(str(x))


def _table(title: str, head: list[str], rows: list[list[str]], left: int = 2) -> str:
    out = [f"<table><caption>{_e(title)}</caption><thead><tr>"]
    wide = ("op", "why", "kind", "stream", "source", "if", "verdict")
    out += [f"<th class=\"l\">{_e(h)}</th>" if i < left or h in wide else f"<th>{_e(h)}</th>"
            for i, h in enumerate(head)]
    out.append("</tr></thead><tbody>")
    for row in rows:
        cells = []
        for i, c in enumerate(row):
            cls = ["l"] if i < left or head[i] in wide else []
            text = str(c)
            if text.startswith("exposed"):
                cls.append("why-exposed")
            elif text.startswith("waiting for"):
                cls.append("why-waiting")
            elif text.startswith("host"):
                cls.append("why-host")
            cells.append(f"<td class=\"{' '.join(cls)}\">{_e(text)}</td>" if cls else f"<td>{_e(text)}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _picture(groups: dict, paths, title: str) -> str:
    from .plot import plot_groups

    with tempfile.TemporaryDirectory() as d:
        png = Path(d) / "timeline.png"
        plot_groups(groups, png, title=title, critical=paths)
        data = base64.b64encode(png.read_bytes()).decode()
    return f'<img class="timeline" alt="timeline of every rank with the critical path" src="data:image/png;base64,{data}">'


def write_html(path: str | Path, analysis, diagnosis: list[dict], groups: dict, title: str,
               extra_tables=()) -> Path:
    """Write the report page; returns its path. `groups`: the picture's lanes (label -> spans)."""
    from .table import diagnosis_tables, path_tables, tables

    parts = [f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{_e(title)}</title>"
             f"<style>{_STYLE}</style></head><body>", f"<h1>{_e(title)}</h1>"]
    if analysis.job is not None:
        parts.append(f"<p class=\"meta\">{_e(analysis.job.describe())}; {len(analysis.report.ranks)} rank(s)"
                     + (f"; clock offsets (ms): {_e(', '.join(f'rank {r} {v:+.3f}' for r, v in analysis.clock_offsets.items()))}"
                        if analysis.clock_offsets else "") + "</p>")
    parts.append("<h2>Timeline</h2>" + _picture(groups, analysis.paths, title))
    if diagnosis:
        parts.append("<h2>Diagnosis</h2>")
        for i, d in enumerate(diagnosis, 1):
            parts.append(f"<div class=\"check\"><span class=\"verdict\">{i}. {_e(d['check'])}: {_e(d['verdict'])}</span>"
                         + (f"<br>evidence: {_e(d['evidence'])}" if d["evidence"] else "")
                         + (f"<br><span class=\"try\">try: {_e(d['try'])}</span>" if d["try"] else "") + "</div>")
    pt = path_tables(analysis)
    if pt:
        parts.append("<h2>Critical path</h2>" + "".join(_table(*t) for t in pt))
    parts.append("<h2>Per rank</h2>" + "".join(_table(*t) for t in tables(analysis.report, detail=True)))
    more = diagnosis_tables(analysis) + list(extra_tables)
    if more:
        parts.append("<h2>Collectives and ranks</h2>" + "".join(_table(*t, left=3) for t in more))
    parts.append(f"<script>{_SCRIPT}</script></body></html>")
    path = Path(path)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text("".join(parts), encoding="utf-8")
    tmp.replace(path)
    return path
