"""Every rank hears the error under torchrun too, where torchrun's agent, not overlapkit, owns the processes.

torchrun tears the job down once one worker exits, so a peer that would learn the cause only
later (from a timeout) is killed before it can say anything: each rank must raise its named error
promptly. `torchrun_probe.py` runs one probe as every rank and prints what each rank heard.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchrun_probe.py")


@pytest.mark.parametrize("case, words", [
    ("tp_shorter", ("[2, 12]", "[2, 8]")),  # TP ranks fed different shapes: named before any collective
    ("dp_skip_backward", ("skipped", "backward")),  # one rank skipped backward under DataParallel
])
def test_every_rank_hears_the_error_under_torchrun(tmp_path, case, words):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", PROBE, case]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=180,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-3000:]
    # Two processes print into one pipe at once, and a message names both ranks: each rank's report is
    # found by its probe marker, which the probe writes in one piece between newlines.
    for rank in (0, 1):
        found = re.search(rf"\[probe rank {rank}\] ([^\n]*)", out.stdout)
        assert found, text[-3000:]
        said = found.group(1).split("[probe rank")[0]
        assert said.startswith("RankMismatchError"), text[-3000:]
        assert all(w in said for w in words), said
