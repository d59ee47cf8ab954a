"""`overlapkit demo --zero 3` trains with ZeRO-3 (FSDP2 + overlapkit prefetch) on TP+SP layers and passes its per-step check
(`--zero 3 --pp 2` runs inside test_zero3_compose's 4-rank world).

With `--overlap pipelined`, which needs sequence parallelism: the demo used to turn SP off under
ZeRO-3 and so refused pipelined there, though the norms' TP gradient sums survive FSDP2."""

import subprocess
import sys


def test_demo_zero3_runs_and_matches_one_process():
    cmd = [sys.executable, "-m", "overlapkit", "demo", "--zero", "3", "--tp", "2", "--dp", "2", "--steps", "3",
           "--overlap", "pipelined", "--plot", "", "--timeout", "60"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "demo passed" in out and "ZeRO-3" in out, out[-3000:]
    assert "zero_all_gather" in out and "zero_reduce_scat" in out, out[-3000:]
    assert "redistributing" not in out, out[-3000:]


def test_demo_zero3_refuses_what_it_does_not_run():
    done = subprocess.run([sys.executable, "-m", "overlapkit", "demo", "--zero", "3", "--cp", "2", "--plot", ""],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "zero=3 runs with tp, dp and pp only" in done.stderr, done.stderr
