"""`overlapkit demo` refuses what cannot work before it starts any rank.

Before: `--tp 64 --dp 64` started 4096 gloo ranks on a 2-core machine (load 130, until killed),
and `--plot /proc/t.png` passed the folder check (root may "write" /proc) and failed only after
the whole run. Each refusal here is one line and exit code 2, in well under a second of work.
"""

from __future__ import annotations

import time

import pytest

from overlapkit import launch
from overlapkit.cli import main


def _demo(capsys, *args) -> tuple[int, list[str], float]:
    t0 = time.monotonic()
    code = main(["demo", *args])
    return code, capsys.readouterr().err.strip().splitlines(), time.monotonic() - t0


def test_a_world_far_beyond_the_cores_is_refused_before_spawning(capsys, monkeypatch):
    monkeypatch.setattr(launch, "cpu_cores", lambda: 2)
    started = []
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: started.append(a))
    code, lines, took = _demo(capsys, "--tp", "64", "--dp", "64", "--plot", "")
    assert code == 2 and not started
    assert len(lines) == 1 and lines[0].startswith("overlapkit demo: --tp 64 --dp 64: 4096 gloo ranks on 2 CPU cores"), lines
    assert "--oversubscribe" in lines[0] and "8 this machine runs" in lines[0]
    assert took < 5.0


def test_oversubscribe_starts_them_anyway(capsys, monkeypatch):
    monkeypatch.setattr(launch, "cpu_cores", lambda: 2)
    asked = []

    def fake_spawn(fn, world, *args, **kw):
        asked.append(world)
        raise launch.RankFailed("rank 0 of 12 failed: stop here")
    monkeypatch.setattr(launch, "spawn", fake_spawn)
    code, lines, _ = _demo(capsys, "--tp", "2", "--dp", "6", "--plot", "", "--oversubscribe")
    assert asked == [12] and code == 1, (asked, lines)


def test_spawn_itself_refuses_and_allows_a_small_world_everywhere(monkeypatch):
    monkeypatch.setattr(launch, "cpu_cores", lambda: 1)
    with pytest.raises(ValueError, match=r"9 gloo ranks on 1 CPU core is more than the 8 .* spawn\(oversubscribe=True\)"):
        launch.spawn(print, 9)
    launch.check_world_fits(8)  # a 2 x 2 x 2 demo on a one-core laptop
    launch.check_world_fits(4096, "nccl")  # one a GPU: the GPU count bounds those
    monkeypatch.setattr(launch, "cpu_cores", lambda: 16)
    launch.check_world_fits(64)
    with pytest.raises(ValueError):
        launch.check_world_fits(65)


@pytest.mark.parametrize("flag, path, says", [
    ("--plot", "/proc/t.png", "nothing can be written in /proc"),
    ("--plot", "/no/such/folder/t.png", "does not exist"),
    ("--plot", "/tmp", "is a folder"),
    ("--trace", "/proc/traces", "cannot be created"),
])
def test_outputs_are_checked_before_any_rank_starts(capsys, monkeypatch, flag, path, says):
    started = []
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: started.append(a))
    args = ["--tp", "1", "--dp", "1", flag, path] + (["--plot", ""] if flag == "--trace" else [])
    code, lines, took = _demo(capsys, *args)
    assert code == 2 and not started, lines
    assert len(lines) == 1 and lines[0].startswith(f"overlapkit demo: {flag} {path}") and says in lines[0], lines
    assert took < 5.0
