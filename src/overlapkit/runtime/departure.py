"""A rank that left a reason on the store stays until its peers could read it.

Nothing here overlaps anything. Under mp.spawn and env:// rank 0's process hosts the job's
store, and under any launcher a process that exits tears down its side of every connection;
mp.spawn's parent even terminates every other rank as soon as one exits with an error. So a
rank that says why it breaks step (`agreement.report_problem`) and exits at once leaves its
peers a "connection reset" and no store to read the reason from. Here, at interpreter exit,
such a rank first closes its process groups (peers blocked in a collective with it fail now,
not at their timeout, and look the reason up), then keeps its process — and the store it may
host — until every other rank of the world has read it or is leaving, or a bounded grace (the world's
timeout + `GRACE_S`, at most `MOST_S`) is over. Every rank that used the store for an overlapkit check says
"leaving" at its own exit, so a job whose ranks all end promptly waits for nothing.
"""

from __future__ import annotations

import atexit
import time

import torch.distributed as dist

from . import state
from .timeouts import world_timeout_s

_HELD: dict = state.cache_dict("departure.held")
"""This process's hold on the job's store: {"store", "rank", "world", "timeout_s", "published"}."""

GRACE_S = 2.0
"""Past the world's timeout, how long a rank that published a reason waits for its peers to leave."""
MOST_S = 30.0
"""The longest a rank waits at exit whatever the timeout (torch's default timeouts are 10 and 30 minutes)."""
LEFT = "overlapkit/left/"
"""Store key prefix: `LEFT + str(rank)` is set when that rank's process exits."""
HEARD = "overlapkit/heard/"
"""Store key prefix: `HEARD + str(rank)` is set when that rank has read a peer's reason."""


def hold_store(published: bool = False) -> None:
    """Keep a reference to the job's store for this process's exit (once), `published`: this rank left a reason."""
    if not dist.is_initialized():
        return
    if "store" not in _HELD:
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - no store (a group built without one): nothing to hold
            return
        first = not _HELD.get("registered")
        _HELD.update(store=store, rank=dist.get_rank(), world=dist.get_world_size(), timeout_s=world_timeout_s(),
                     registered=True)
        if first:
            atexit.register(_leave)
    if published:
        _HELD["published"] = True


def _leave() -> None:
    held = dict(_HELD)
    if "store" not in held:
        return
    _HELD.pop("store", None)
    store = held["store"]
    try:
        store.set(LEFT + str(held["rank"]), "1")
    except Exception:  # noqa: BLE001 - the store's host is gone already: nothing to wait for
        return
    if not held.get("published"):
        return
    if dist.is_initialized():
        try:
            dist.destroy_process_group()  # peers blocked with this rank fail now and read the reason
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    me = held["rank"]
    deadline = time.monotonic() + min(held["timeout_s"] + GRACE_S, MOST_S)
    while time.monotonic() < deadline:
        try:
            if all(store.check([LEFT + str(r)]) or store.check([HEARD + str(r)])
                   for r in range(held["world"]) if r != me):
                return
        except Exception:  # noqa: BLE001 - the store's host is gone: nobody can read it any more
            return
        time.sleep(0.05)


def heard() -> None:
    """Say on the store that this rank has read a peer's reason (that peer need not wait for it any more)."""
    try:
        dist.distributed_c10d._get_default_store().set(HEARD + str(dist.get_rank()), "1")
    except Exception:  # noqa: BLE001 - no store: the publisher's grace ends on its own
        pass
