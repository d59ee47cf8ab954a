"""Cross-rank agreement: ranks compare a small signature before they exchange anything big.

Nothing here overlaps anything. It exists so that an argument or shape that differs between
the ranks of a group (chunks, a sequence length, an overlap mode, SP on one rank only) fails
on every rank with one message naming the field and each rank's value, instead of one rank
dying inside the transport while another returns a result read from a buffer no transfer
filled.

The comparison goes through the job's rendezvous store, not through a collective of the
group: a rank that checks while another skips its check (it reused a configuration it had
seen, this one has a new one) then cannot meet the other's data collective and read its
bytes as a signature. It waits on the store instead and fails within the timeout, naming the
ranks that never answered. Engines check the first time they see a configuration
(`Agreement.check`), so the steady state costs a set lookup and nothing else.
"""

from __future__ import annotations

import datetime
import json
import re
import time
from typing import Any

import torch.distributed as dist

from . import state
from .departure import heard, hold_store
from .timeouts import group_timeout_s

_SEQ: dict[str, int] = state.cache_dict("agreement.checks_per_group")
"""Checks made so far on each group, by group name. Process state, not configuration: the k-th
check of a group on one rank is compared with the k-th check of the same group on the others."""


class RankMismatchError(ValueError):
    """Ranks of one group were given different configurations (raised on every rank, same text)."""


def _describe(value: Any) -> Any:
    # Signatures cross processes as JSON: shapes become lists, dtypes and modes their names.
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (tuple, list)):
        return [_describe(v) for v in value]
    return str(value)


def agree(group, what: str, *, timeout_s: float | None = None, **fields: Any) -> None:
    """Raise RankMismatchError on every rank of `group` unless all passed the same `fields`.

    `what` names the layer or engine (it is part of the signature, so two ranks checking
    different things also fail). Costs one store round trip per rank; meant for the first
    call of a configuration, not every step. A group of one rank, or no group, passes.
    """
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    mine = {"what": what, **{k: _describe(v) for k, v in fields.items()}}
    ranks = dist.get_process_group_ranks(group)
    signatures = exchange(group, what, mine, timeout_s=timeout_s)
    if all(s == signatures[0] for s in signatures):
        return
    fields_differ = sorted({k for s in signatures for k in s if any(t.get(k) != s.get(k) for t in signatures)})
    parts = []
    for k in fields_differ:
        per_rank = ", ".join(f"rank {ranks[r]}: {signatures[r].get(k, '(absent)')!r}" for r in range(len(ranks)))
        parts.append(f"{k} differs ({per_rank})")
    hold_store(published=True)  # every rank raises; the store's host stays until the others have read theirs
    whats = sorted({s.get("what") for s in signatures}, key=str)
    label = what if len(whats) == 1 else "/".join(map(str, whats))
    raise RankMismatchError(f"{label}: ranks {ranks} were given different configurations: " + "; ".join(parts))


def exchange(group, what: str, mine: dict, *, timeout_s: float | None = None) -> list[dict]:
    """Every rank's `mine` (JSON-able), in group rank order, through the job's store.

    Every rank of `group` must call it the same number of times (the k-th call meets the k-th).
    Raises RankMismatchError naming the ranks that did not answer within the timeout (the
    group's own unless `timeout_s` says otherwise).
    """
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank(group)
    name = group.group_name
    seq = _SEQ.get(name, 0)
    _SEQ[name] = seq + 1
    store = dist.distributed_c10d._get_default_store()
    hold_store()
    prefix = f"overlapkit/agree/{name}/{seq}/"
    store.set(prefix + str(me), json.dumps(mine, sort_keys=True))
    keys = [prefix + str(r) for r in range(len(ranks))]
    timeout = timeout_s if timeout_s is not None else group_timeout_s(group)
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception:
        missing = [ranks[r] for r in range(len(ranks)) if r != me and not store.check([keys[r]])]
        raise RankMismatchError(
            f"{what}: rank(s) {missing} of the group {ranks} did not compare their configuration within "
            f"{timeout:g} s (check #{seq} of this group): they are stuck, dead, or reused a configuration "
            f"this rank ({dist.get_rank()}) has not used before; this rank has {_fmt(mine)}") from None
    return [json.loads(store.get(k)) for k in keys]


# -- what a rank says before it breaks step with the others ----------------------------------

def report_problem(group, what: str, text: str) -> None:
    """Leave `text` on the store for the other ranks of `group`, before this rank breaks step with them.

    A rank that finds, on its own, that it cannot go on in step (its model changed, it ran a
    different block) says why here before it raises or waits; a peer whose collective then
    fails reads it with `explain_failure` and names this rank and its reason, instead of a
    transport's "connection closed" or "timeout". One store write; nothing when all is well.
    """
    if group is None or not dist.is_initialized():
        return
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"overlapkit/problem/{group.group_name}/{dist.get_rank(group)}",
                  json.dumps({"what": what, "rank": dist.get_rank(), "text": text}))
        hold_store(published=True)  # stay, at exit, until the peers could read it
    except Exception:  # noqa: BLE001 - the store is gone: the rank's own error still says it
        pass


def reported_problems(group) -> list[dict]:
    """What other ranks of `group` left with `report_problem` (each {"what", "rank", "text"})."""
    if group is None or not dist.is_initialized():
        return []
    out = []
    try:
        store = dist.distributed_c10d._get_default_store()
        me = dist.get_rank(group)
        world = dist.group.WORLD.group_name
        for r, world_rank in enumerate(dist.get_process_group_ranks(group)):
            # The group's own reasons, and a rank's error said for the whole job (launch.publish_failure).
            for key in {f"overlapkit/problem/{group.group_name}/{r}", f"overlapkit/problem/{world}/{world_rank}"}:
                if r != me and store.check([key]):
                    out.append(json.loads(store.get(key)))
    except Exception:  # noqa: BLE001 - no store to read (its host rank is gone): nothing to add
        return out
    return out


def raise_explained(group, what: str, error: BaseException, doing: str = "") -> None:
    """Re-raise `error`, a failed collective of `group`, as the reason a peer left, if one did.

    A peer's reason is what it left with `report_problem`, or a configuration check it is waiting
    in that this rank never reached (it has a configuration this rank reused, say one rank cast
    its model to float64: its layers compare the new signature while this rank, with the one it
    had seen, went on into the collective). `doing` says what this rank was waiting for.
    Without a reason from a peer, `error` itself is raised (the transport's message is all there is).
    Call it inside the `except` that caught `error`.
    """
    if isinstance(error, RankMismatchError):
        raise error  # explained already, by a wait nested inside this one
    hold_store()
    _say_waiting(what, doing)
    told = reported_problems(group) if group is not None else []
    if told:
        heard()
    told += _checks_ahead(group) if group is not None else []
    if not told and group is not None:
        # No one left a reason: a peer stuck elsewhere (it skipped backward(), or a step) times out
        # too, about now. Each says where it waits; the places name the rank that went astray.
        told = _peers_waiting(group)
    if not told:
        raise error
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    first = re.sub(r"\[[^\]]*:\d+\] ", "", first)  # gloo's source location says nothing to a user
    reasons = "; ".join(f"rank {t['rank']}: {t['text']}" for t in told)
    here = f"rank {dist.get_rank()}" + (f", waiting for {doing}" if doing else "")
    raise RankMismatchError(f"{what}: another rank broke step with this one ({here}: {first[:200]}); "
                            f"{reasons}") from error


STATUS_WAIT_S = 1.5
"""After a failed wait with no reason left, how long a rank waits for its peers to say where they wait."""


def _say_waiting(what: str, doing: str) -> None:
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"overlapkit/waiting/{dist.get_rank()}",
                  json.dumps({"what": what, "doing": doing or "a collective", "at": time.time()}))
    except Exception:  # noqa: BLE001 - no store: the transport's words are all there is
        pass


def _peers_waiting(group) -> list[dict]:
    """Where the other ranks of `group` wait (what they said in `_say_waiting` this last while)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        me, ranks = dist.get_rank(), dist.get_process_group_ranks(group)
        fresh_s = STATUS_WAIT_S + 3.5  # peers stuck with this rank time out together; older is another failure
        found: dict[int, dict] = {}
        deadline = time.monotonic() + STATUS_WAIT_S
        while True:
            for r in ranks:
                key = f"overlapkit/waiting/{r}"
                if r != me and r not in found and store.check([key]):
                    said = json.loads(store.get(key))
                    if abs(time.time() - said["at"]) < fresh_s:
                        found[r] = said
            if len(found) == len(ranks) - 1 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return [{"rank": r, "text": f"{s['what']} waits for {s['doing']}"} for r, s in sorted(found.items())]
    except Exception:  # noqa: BLE001 - no store to read: nothing to add
        return []


def _checks_ahead(group) -> list[dict]:
    """Peers of `group` waiting in a configuration check this rank has not made (its next one)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        name, me = group.group_name, dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group)
        seq = _SEQ.get(name, 0)
        out = []
        for r in range(len(ranks)):
            key = f"overlapkit/agree/{name}/{seq}/{r}"
            if r != me and store.check([key]):
                theirs = json.loads(store.get(key))
                out.append({"rank": ranks[r], "text": f"{theirs.get('what')} compared a configuration this rank did "
                            f"not (this rank went on with one it had used before): {_fmt(theirs)}"})
        return out
    except Exception:  # noqa: BLE001 - no store to read: nothing to add
        return []


def _fmt(signature: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in signature.items() if k != "what")


class Agreement:
    """The configurations one engine instance has already checked, so seen ones cost nothing."""

    __slots__ = ("what", "_seen")

    def __init__(self, what: str) -> None:
        self.what = what
        self._seen: set = set()

    def check(self, group, **fields: Any) -> None:
        """`agree(group, self.what, **fields)` the first time these exact fields are seen here."""
        # The hot path: one call site passes its fields in one order, so the items are the key.
        try:
            key = tuple(fields.items())
            if key in self._seen:
                return
        except TypeError:  # an unhashable value (a list): compare its text instead
            key = tuple((k, repr(v)) for k, v in fields.items())
            if key in self._seen:
                return
        agree(group, self.what, **fields)
        self._seen.add(key)
