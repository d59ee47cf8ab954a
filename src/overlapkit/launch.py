"""Start N local ranks (gloo on CPU, or NCCL one GPU a rank) and run a function in each.

Used by the demo, the benchmarks and the tests' `@distributed` helper. Every rank gets a
short process-group timeout so that a rank that fails can never leave the others hanging for
long, and the first failure is raised in the parent with the failing rank named: a rank that
raised, one that died (killed, a C++ abort), or one that stopped answering.

Ranks can send one-line progress messages to the parent (`progress(text)`), which prints
them while the ranks run (`spawn(..., on_message=print)`), so a user sees the ranks start,
import and step from the first second instead of a silent wait.

CPU ranks fork from a server process that imported torch once (multiprocessing's forkserver,
which never touches CUDA), instead of each rank starting an interpreter and importing torch
again: seconds a rank on a small machine. Each rank sends its result and progress back on its
own pipe, so no manager process is started per world either.
"""

from __future__ import annotations

import datetime
import multiprocessing.connection
import os
import pickle
import signal
import socket
import time
import traceback
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .runtime import state

_WIRING = state.process_dict("launch.parent")
"""In a spawned rank: its channel to the parent under key "messages" (set by _entry); empty outside spawn."""


class RankFailed(RuntimeError):
    """A spawned rank raised, died or stopped answering; the message's first line names it."""

    def __init__(self, message: str, rank: int | None = None, detail: str = "") -> None:
        super().__init__(message + (f"\n{detail}" if detail else ""))
        self.rank, self.summary, self.detail = rank, message, detail


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def progress(text: str) -> None:
    """From a rank: send one line of progress to the parent (a no-op outside `spawn`)."""
    messages = _WIRING.get("messages")
    if messages is not None:
        messages.put((int(os.environ.get("RANK", 0)), text))


class _Channel:
    """A rank's one-way pipe to the parent: progress lines, then its result or its error.

    One pipe a rank, so no lock is shared between ranks (a rank killed mid-write can block no
    other rank) and each rank's messages arrive in the order it sent them. Plain pickle, not
    multiprocessing's: that one sends a tensor as a handle to the rank's shared memory, which
    is gone once the rank exits; plain pickle copies the values.
    """

    def __init__(self, conn) -> None:
        self.conn = conn

    def put(self, item) -> None:
        self.conn.send_bytes(pickle.dumps(("message", item)))

    def result(self, value) -> None:
        self.conn.send_bytes(pickle.dumps(("ok", value)))

    def error(self, text: str, trace: str) -> None:
        self.conn.send_bytes(pickle.dumps(("error", text, trace)))


def _entry(rank: int, fn: Callable, world_size: int, port: int, backend: str, timeout_s: float,
           args: tuple, conns: list, environ: dict) -> None:
    channel = _WIRING["messages"] = _Channel(conns[rank])
    # A forked rank inherits its server's environment, not the parent's now: take the parent's.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    torch.set_num_threads(int(os.environ.get("OVERLAPKIT_RANK_THREADS", "1")))  # N ranks share few cores
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    progress("joined the process group")
    ok = False
    try:
        out = fn(*args)
        channel.result(out)
        ok = True
    except BaseException as e:  # the parent re-raises it with the rank named
        channel.error(f"{type(e).__name__}: {e}", traceback.format_exc())
        publish_failure(e)
        raise
    finally:
        shutdown(joined=ok)


def publish_failure(error: BaseException) -> None:
    """Leave this rank's error on the store for the peers still waiting on it (see agreement.report_problem).

    A peer whose collective then fails raises this text instead of "connection reset"; this
    process stays at exit until the peers read it (runtime/departure.py). An error that is
    itself a peer's reason heard (RankMismatchError) is not said again.
    """
    from .runtime.agreement import RankMismatchError, report_problem

    if isinstance(error, RankMismatchError) or not dist.is_initialized():
        return
    first = (str(error).strip().splitlines() or [""])[0][:300]
    if _is_consequence(first):
        return  # this rank lost a peer: the peer's own reason (or its absence) is what to tell
    report_problem(dist.group.WORLD, f"rank {dist.get_rank()}", f"raised {type(error).__name__}: {first}")


def _is_consequence(text: str) -> bool:
    """The words of an error a rank gets because a peer failed or went quiet (not a reason of its own)."""
    text = text.lower()
    return any(w in text for w in ("timed out", "timeout", "connection closed", "connection reset", "broken pipe",
                                   "did not compare", "pair closure"))


def shutdown(joined: bool = True) -> None:
    """Destroy every process group of this rank, after joining the work still in flight on them.

    `joined=True` (every rank finished its work and calls this): each group this rank belongs to
    runs a barrier, in the order the groups were created (the same on every rank, so no two
    ranks wait on each other in a circle). A gloo barrier first waits for all earlier work on its
    group, so a collective nobody waited for (a sharded optimizer's last parameter gather, a
    recorded transfer whose completion callback is pending) completes now, while the interpreter
    is alive: one completing during interpreter shutdown makes gloo's thread take the GIL from a
    dying interpreter, and the process dies with SIGABRT after a correct result. Then the
    subgroups are destroyed before the world (torch's `destroy_process_group` order).
    `joined=False` (this rank failed): destroy at once; the others may be stuck, and waiting for
    them here would only hide this rank's error behind their timeout.
    """
    if not dist.is_initialized():
        return
    if joined:
        c10d = dist.distributed_c10d
        world = c10d._get_default_group()
        if torch.cuda.is_available() and dist.get_backend(world) == "nccl":
            torch.cuda.synchronize()
        try:
            for group in [g for g in list(c10d._world.pg_names) if g is not world] + [world]:
                if dist.get_backend(group) == "gloo":
                    dist.barrier(group=group)
        except Exception:  # noqa: BLE001 - a peer failed after all: its own error is the one that matters
            pass
    dist.destroy_process_group()


RANKS_PER_CORE = 4
"""Most CPU ranks `spawn` starts per core without being told to oversubscribe (at least MIN_RANKS)."""
MIN_RANKS = 8
"""Ranks `spawn` always allows, whatever the core count: a laptop runs a 2 x 2 x 2 demo."""


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_world_fits(world_size: int, backend: str = "gloo", what: str = "",
                     force: str = "spawn(oversubscribe=True)") -> None:
    """Refuse (ValueError) to start far more CPU ranks than this machine has cores, before starting any.

    Each gloo rank is a process that imports torch and spins threads: 4096 of them on two cores
    load the machine for as long as they are let run and finish nothing. NCCL ranks are bounded
    by the GPUs instead (one a GPU).
    """
    if backend == "nccl":
        return
    cores = cpu_cores()
    most = max(MIN_RANKS, RANKS_PER_CORE * cores)
    if world_size > most:
        raise ValueError(f"{what or f'{world_size} ranks'}: {world_size} {backend} ranks on {cores} CPU core"
                         f"{'s' if cores != 1 else ''} is more than the {most} this machine runs in reasonable time "
                         f"({RANKS_PER_CORE} a core, at least {MIN_RANKS}); ask for fewer, or pass {force} to start "
                         "them anyway")


def spawn(fn: Callable, world_size: int, *args: Any, backend: str = "gloo",
          timeout_s: float = 60.0, on_message: Callable[[int, str], None] | None = None,
          oversubscribe: bool = False, preload: tuple[str, ...] = ()) -> list[Any]:
    """Run `fn(*args)` on `world_size` fresh processes with an initialized default group.

    Returns the list of per-rank return values (they must be picklable). Raises RankFailed
    naming the rank (its error on the first line, its traceback after) if any rank fails.
    `on_message(rank, text)` receives what ranks send with `progress()` while they run.
    Far more CPU ranks than cores are refused (ValueError, nothing started) unless `oversubscribe`.
    `preload`: modules every rank imports anyway (see `start_method`), imported once for all ranks.
    """
    if not oversubscribe:
        check_world_fits(world_size, backend)
    method = start_method(backend, (*preload, *_home_module(fn)))
    pipes = [multiprocessing.get_context(method).Pipe(duplex=False) for _ in range(world_size)]
    results: dict = {}
    port = free_port()
    started = time.monotonic()
    stopped: set[int] = set()
    try:
        procs = _start_ranks(method, world_size, (fn, world_size, port, backend, timeout_s, args,
                                                  [w for _, w in pipes], dict(os.environ)))
        for _, w in pipes:
            w.close()  # the ranks hold theirs; the parent only reads
        readers = {r: pipe[0] for r, pipe in enumerate(pipes)}
        try:
            # grace_period: a stopped (SIGSTOP) rank ignores SIGTERM; without it torch waits 30 s to SIGKILL.
            # A short join timeout: a rank whose result fills its pipe waits for this loop to read it.
            while not procs.join(timeout=0.05, grace_period=2.0):
                _drain(readers, results, on_message, wait_s=0.05)
                _end_stopped(procs, results, stopped)
        finally:
            _drain(readers, results, on_message, wait_s=0.0, until_closed=True)
    except Exception as e:
        failure = _failure(e, results, world_size, time.monotonic() - started, timeout_s)
        raise _named_stopped(failure, stopped, world_size, time.monotonic() - started, timeout_s) from None
    finally:
        for r, w in pipes:
            r.close()
            w.close()  # a no-op unless starting the ranks failed
    return [results.get(r, (None, None))[1] for r in range(world_size)]


PRELOAD = ("torch", "torch.distributed", "overlapkit.launch")
"""Modules the rank server imports once for every CPU rank it forks (`spawn(preload=...)` adds more)."""


def start_method(backend: str, preload: tuple[str, ...] = ()) -> str:
    """How `spawn` starts ranks: "forkserver" for CPU ranks where the platform has it, else "spawn".

    The server imports `PRELOAD + preload` once (spawn adds the module of the function the ranks
    run), so a forked rank starts with torch and that module imported.
    It imports nothing that initializes CUDA, but NCCL ranks keep "spawn": a GPU rank's start-up
    is small beside its work, and a fresh interpreter rules out any state a fork could carry.
    A server already running keeps the modules it first imported.
    """
    if backend == "nccl" or "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(dict.fromkeys(PRELOAD + tuple(preload))))
    return "forkserver"


def _start_ranks(method: str, world_size: int, args: tuple):
    try:
        return mp.start_processes(_entry, args=args, nprocs=world_size, join=False, start_method=method)
    except (EOFError, ConnectionError) as e:
        if method != "forkserver":
            raise
        # The server died before forking a rank: a module it preloads raised on import (its traceback is
        # on stderr). Fresh interpreters do not depend on it; they only start slower.
        warnings.warn(f"the rank server failed ({type(e).__name__}: {e}); starting the ranks with 'spawn'",
                      RuntimeWarning, stacklevel=3)
        return mp.start_processes(_entry, args=args, nprocs=world_size, join=False, start_method="spawn")


def _home_module(fn: Callable) -> tuple[str, ...]:
    """The module `fn` is defined in, which every rank imports to find it (none for a script's own `__main__`)."""
    module = getattr(fn, "__module__", None) or ""
    return () if not module or module.split(".")[-1] in ("__main__", "__mp_main__") else (module,)


def _drain(readers: dict, results: dict, on_message, wait_s: float, until_closed: bool = False) -> None:
    """Read what the ranks sent: progress lines to `on_message`, final results into `results`.

    `until_closed`: every rank has ended; read each pipe to its end. A rank killed mid-send leaves
    a truncated message: it counts as no result (the rank is reported dead or silent).
    """
    while readers:
        ready = multiprocessing.connection.wait(list(readers.values()), timeout=wait_s)
        if not ready:
            return
        for rank, conn in list(readers.items()):
            if conn not in ready:
                continue
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                del readers[rank]
                continue
            try:
                item = pickle.loads(data)
            except Exception:  # noqa: BLE001 - a result the parent cannot unpickle is that rank's error
                results[rank] = ("error", "its result could not be read in the parent", traceback.format_exc())
                continue
            if item[0] == "message":
                if on_message is not None:
                    on_message(*item[1])
            else:
                results[rank] = item
        if not until_closed:
            wait_s = 0.0


def _end_stopped(procs, results, stopped: set) -> None:
    """Once a rank has failed, SIGKILL the ranks that are stopped (SIGSTOP, a debugger): they cannot
    answer, and torch would give each a SIGTERM it ignores and a grace period first."""
    if not any(v[0] == "error" for v in results.values()):
        return
    for rank, proc in enumerate(procs.processes):
        if rank in stopped or not proc.is_alive():
            continue
        try:
            with open(f"/proc/{proc.pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:  # not Linux, or it just ended
            continue
        if state in ("T", "t"):
            stopped.add(rank)
            os.kill(proc.pid, signal.SIGKILL)


def _named_stopped(failure: RankFailed, stopped: set, world_size: int, elapsed_s: float,
                   timeout_s: float) -> RankFailed:
    """The failure, or, when a rank ended only because it was stopped and killed here, that rank named."""
    if not stopped or failure.rank not in stopped:
        return failure
    rank = min(stopped)
    return RankFailed(f"rank {rank} of {world_size} stopped answering: it was stopped (SIGSTOP) and the other ranks "
                      f"gave up waiting for it after the {timeout_s:g} s process-group timeout ({elapsed_s:.0f} s in "
                      "all)", rank, failure.detail)


def _failure(e: Exception, results: dict, world_size: int, elapsed_s: float, timeout_s: float) -> RankFailed:
    index = getattr(e, "error_index", None)
    signal_name = getattr(e, "signal_name", None)
    exit_code = getattr(e, "exit_code", None)
    if index is not None and index not in results and (signal_name or exit_code):
        # The first process torch saw end was one that never reported: it died (killed, aborted).
        how = f"was killed by {signal_name}" if signal_name else f"exited with code {exit_code}"
        return RankFailed(f"rank {index} of {world_size} died: it {how} after {elapsed_s:.0f} s", index)
    errors = {r: v for r, v in results.items() if v[0] == "error"}
    # A rank that raised first is the cause; the others' errors are often its consequence
    # (their collective lost its peer). Prefer a non-timeout error, then the lowest rank.
    if errors:
        def is_consequence(v):
            return _is_consequence(v[1])
        rank = min(errors, key=lambda r: (is_consequence(errors[r]), r))
        silent = [r for r in range(world_size) if r not in results]
        if silent and is_consequence(errors[rank]):
            # Everyone who spoke timed out waiting: the ranks that never finished are the cause.
            return RankFailed(f"rank {silent[0]} of {world_size} stopped answering: the other ranks gave up "
                              f"waiting for it after the {timeout_s:g} s process-group timeout "
                              f"({elapsed_s:.0f} s in all)", silent[0], errors[rank][2])
        first = errors[rank][1].strip().splitlines()[0] if errors[rank][1].strip() else "failed"
        return RankFailed(f"rank {rank} of {world_size} failed: {first}", rank, errors[rank][2])
    return RankFailed(f"a rank of {world_size} died: {e}")
