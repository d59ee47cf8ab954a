"""`analyze --html`: one self-contained page, opened in a real headless browser (chromium), non-blank,
with no console error; and `--compare A B` on two runs of one job."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from overlapkit.timeline.cli import main

DATA = Path(__file__).resolve().parents[1] / "data" / "timeline"
DDP = [str(DATA / "gloo_ddp_rank0.json.gz"), str(DATA / "gloo_ddp_rank1.json.gz")]
BROWSER = next((b for b in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
                if shutil.which(b)), None)


def _report(tmp_path) -> Path:
    out = tmp_path / "report.html"
    assert main(DDP + ["--diagnose", "--html", str(out)]) == 0
    return out


def test_the_page_is_self_contained_and_holds_every_part(tmp_path, capsys):
    page = _report(tmp_path).read_text()
    capsys.readouterr()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    # nothing fetched: no external script, style, image or font
    assert not re.search(r'(src|href)\s*=\s*"(https?:|//)', page) and "<link" not in page
    assert re.search(r'<img class="timeline"[^>]+src="data:image/png;base64,[A-Za-z0-9+/=]{1000,}"', page)
    for part in ("<h2>Timeline</h2>", "<h2>Diagnosis</h2>", "<h2>Critical path</h2>", "<h2>Per rank</h2>",
                 "Critical path of step", "What-if, on the critical path", "waiting for rank",
                 "7. what to change", "torch DDP"):
        assert part in page, part


def test_a_bad_html_path_fails_before_any_work(tmp_path, capsys):
    assert main(DDP + ["--html", str(tmp_path / "missing" / "r.html")]) == 2
    assert "does not exist" in capsys.readouterr().err


def _chromium(args, timeout=90):
    return subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--enable-logging=stderr", "--v=0"] + args, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.skipif(BROWSER is None, reason="no headless browser here (apt-get install -y chromium to run this)")
def test_the_page_renders_in_a_browser_without_console_errors(tmp_path, capsys):
    page = _report(tmp_path)
    capsys.readouterr()
    shot = tmp_path / "shot.png"
    run = _chromium(["--window-size=1400,1800", f"--screenshot={shot}", page.as_uri()])
    assert shot.exists(), run.stderr[-2000:]
    import matplotlib.image as mpimg
    import numpy as np

    img = mpimg.imread(shot)[..., :3]
    colours = len(np.unique((img * 255).astype(np.uint8).reshape(-1, 3), axis=0))
    ink = float((img.min(axis=2) < 0.9).mean())  # share of pixels that are not (nearly) white
    assert colours > 50 and ink > 0.05, (colours, ink)
    dom = _chromium(["--dump-dom", page.as_uri()])
    assert re.search(r'data-ready="\d+"', dom.stdout), "the page's script did not run to its end"
    console = [line for line in (run.stderr + dom.stderr).splitlines() if ":CONSOLE" in line]
    assert console == [], console


def test_compare_two_runs(tmp_path, capsys):
    # the same job as A and as B: every row 'same'; against the DLRM job every kind differs
    a = tmp_path / "a"
    a.mkdir()
    for f in DDP:
        shutil.copy(f, a)
    assert main(["--compare", str(a), str(a), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["compare"]
    assert {r["by"] for r in rows} == {"critical path", "rank", "collective", "phase"}
    assert {r["verdict"] for r in rows} == {"same"} and all(r["delta"] == 0 for r in rows)
    # B: rank 1's trace as rank 0's run (a slower run of the same job): the step got slower
    b = tmp_path / "b"
    b.mkdir()
    shutil.copy(DDP[0], b / "rank0.json.gz")
    c = tmp_path / "c"
    c.mkdir()
    shutil.copy(DDP[1], c / "rank1.json.gz")
    assert main(["--compare", str(b), str(c), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["compare"]
    step = next(r for r in rows if r["by"] == "critical path" and r["name"] == "step (critical path)")
    assert step["b"] > step["a"] and step["verdict"] == "slower" and step["ratio"] == pytest.approx(step["b"] / step["a"])
    assert any(r["by"] == "rank" and r["verdict"] in ("gone", "new") for r in rows)  # rank 0 in A only, rank 1 in B
    assert main(["--compare", str(b), str(c)]) == 0
    out = capsys.readouterr().out
    assert "by collective" in out and "by phase" in out and "slower" in out
