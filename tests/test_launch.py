"""How `launch.spawn` starts ranks and hears from them: forked from a server that imported torch once,
each rank answering on its own pipe."""

import multiprocessing
import os
import subprocess
import sys

import torch
import torch.distributed as dist

from overlapkit.launch import spawn, start_method


def _env_and_big_result(n):
    # A result far larger than a pipe's buffer: the rank blocks writing it until the parent reads.
    from overlapkit.launch import progress
    for i in range(3):
        progress(f"step {i}")
    return os.environ.get("OVERLAPKIT_LAUNCH_MARK"), torch.arange(n, dtype=torch.float32) * (dist.get_rank() + 1)


def test_ranks_see_the_parents_environment_now_and_return_large_tensors_by_value(monkeypatch):
    # Set after the rank server started (conftest starts it): a forked rank must still see it.
    monkeypatch.setenv("OVERLAPKIT_LAUNCH_MARK", "set-late")
    heard = []
    n = 1 << 20
    out = spawn(_env_and_big_result, 2, n, on_message=lambda rank, text: heard.append((rank, text)))
    for rank, (mark, t) in enumerate(out):
        assert mark == "set-late", f"rank {rank} saw OVERLAPKIT_LAUNCH_MARK={mark!r}"
        assert torch.equal(t, torch.arange(n, dtype=torch.float32) * (rank + 1)), f"rank {rank}: wrong values"
    for rank in range(2):
        steps = [text for r, text in heard if r == rank and text.startswith("step")]
        assert steps == ["step 0", "step 1", "step 2"], f"rank {rank}'s progress arrived as {steps}"


def test_cpu_ranks_fork_from_a_server_and_gpu_ranks_spawn():
    assert start_method("nccl") == "spawn"
    assert start_method("gloo") == ("forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn")


def test_a_preloaded_module_that_raises_falls_back_to_fresh_interpreters(tmp_path):
    # In a fresh interpreter: this session's server is already running and would ignore the preload.
    (tmp_path / "raises_on_import.py").write_text("raise RuntimeError('broken at import')\n")
    code = ("import operator, warnings\nfrom overlapkit.launch import spawn\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    print(spawn(operator.abs, 2, -3, preload=('raises_on_import',)))\n"
            "print([str(x.message) for x in w])\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result, warned = run.stdout.strip().splitlines()[-2:]
    assert result == "[3, 3]", run.stdout
    assert "starting the ranks with 'spawn'" in warned, run.stdout
