import os
import sys
import time
import warnings

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # so spawned ranks can import tests' helpers
warnings.filterwarnings("ignore", category=FutureWarning, module="torch")

SLOWEST = 10
"""How many of the slowest tests the end-of-run report names."""

_STARTED = pytest.StashKey[float]()


def pytest_configure(config):
    from distributed import start_rank_server

    config.stash[_STARTED] = time.monotonic()
    if not getattr(config.option, "numprocesses", None) or hasattr(config, "workerinput"):
        start_rank_server()  # where tests run: not in pytest-xdist's controller, which runs none


def pytest_terminal_summary(terminalreporter, config):
    # Printed on every run, so CI's log shows the suite's wall time and where it went: a test that
    # grew slow is seen in the change that made it so.
    took = time.monotonic() - config.stash[_STARTED]
    per_test: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for rep in reports:
            if getattr(rep, "when", None) in ("setup", "call", "teardown"):
                per_test[rep.nodeid] = per_test.get(rep.nodeid, 0.0) + rep.duration
    terminalreporter.write_sep("=", f"suite wall time {took:.0f} s ({took / 60:.1f} min), {len(per_test)} tests")
    for nodeid, seconds in sorted(per_test.items(), key=lambda kv: -kv[1])[:SLOWEST]:
        terminalreporter.write_line(f"{seconds:7.1f} s  {nodeid}")
