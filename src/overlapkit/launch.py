"""Start N local ranks (gloo on CPU, or NCCL one GPU a rank) and run a function in each.

Used by the demo, the benchmarks and the tests' `@distributed` helper. Every rank gets a
short process-group timeout so that a rank that fails can never leave the others hanging for
long, and the first failure is raised in the parent with the failing rank named.
"""

from __future__ import annotations

import datetime
import os
import socket
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world_size: int, port: int, backend: str, timeout_s: float,
           args: tuple, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    torch.set_num_threads(1)  # N ranks share few cores: one thread each keeps them from thrashing
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        out = fn(*args)
        results[rank] = ("ok", out)
    except BaseException as e:  # the parent re-raises it with the rank named
        results[rank] = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable, world_size: int, *args: Any, backend: str = "gloo",
          timeout_s: float = 60.0) -> list[Any]:
    """Run `fn(*args)` on `world_size` fresh processes with an initialized default group.

    Returns the list of per-rank return values (they must be picklable). Raises RuntimeError
    naming the rank and its traceback if any rank fails.
    """
    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    results = manager.dict()
    port = free_port()
    try:
        mp.start_processes(_entry, args=(fn, world_size, port, backend, timeout_s, args, results),
                           nprocs=world_size, join=True, start_method="spawn")
    except Exception as e:
        errors = {r: v[1] for r, v in results.items() if v[0] == "error"}
        if errors:
            rank = min(errors)
            raise RuntimeError(f"rank {rank} of {world_size} failed: {errors[rank]}") from None
        raise RuntimeError(f"a rank of {world_size} died: {e}") from None
    finally:
        out = [results.get(r, (None, None))[1] for r in range(world_size)]
        manager.shutdown()
    return out
