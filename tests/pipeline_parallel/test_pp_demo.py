"""`overlapkit demo --pp N --schedule S`: an odd pipeline under DualPipeV passes its check against one
process; the schedules the demo cannot run are refused before anything starts, naming the value."""

import subprocess
import sys

import pytest

from overlapkit.demos import DEMO_SCHEDULES, DemoConfig


def test_demo_dualpipev_on_three_stages_matches_one_process():
    out = subprocess.run([sys.executable, "-m", "overlapkit", "demo", "--pp", "3", "--tp", "1", "--dp", "1",
                          "--schedule", "dualpipev", "--steps", "2", "--plot", "", "--timeout", "60"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "pp=3 dualpipev" in out.stdout and "dualpipev with overlap=bulk, m=6" in out.stderr
    assert "weight-gradient inputs kept" in out.stderr


@pytest.mark.parametrize("kwargs, needle", [
    (dict(pp=2, schedule="zero-bubble"), f"is not one of {DEMO_SCHEDULES}"),
    (dict(pp=1, schedule="zbv"), "needs pp >= 2, got pp=1"),
    (dict(pp=2, schedule="zb1p", zero=3), "fully_shard (zero=3) cannot take"),
])
def test_demo_refuses_schedules_it_cannot_run(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        DemoConfig(tp=1, dp=1, **kwargs)
