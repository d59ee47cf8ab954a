"""Small collectives that make data-parallel ranks agree before they exchange anything big.

Nothing here overlaps: these run once at construction or on a checkpoint load, and exist so
that a mistake on one rank (another model, another layout, a foreign checkpoint) fails on
every rank with the same message instead of leaving the others inside a collective that
never completes. They go through `overlapkit.runtime.comm`, so the timeline sees them too.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from ..runtime import comm


def check_same_on_ranks(values: dict[str, int], group, device: torch.device, what: str) -> None:
    """Raise ValueError on every rank unless every rank of `group` passed the same `values`."""
    if group is None or comm.group_size(group) == 1:
        return
    mine = list(values.values())
    t = torch.tensor(mine + [-v for v in mine], dtype=torch.int64, device=device)
    comm.all_reduce(t, group, kind="dp_all_reduce", name="agree", op=dist.ReduceOp.MAX, async_op=False)
    n = len(mine)
    hi, lo = t[:n].tolist(), [-v for v in t[n:].tolist()]
    differ = [f"{k}={v} here, from {a} to {b} over the ranks"
              for (k, v), a, b in zip(values.items(), lo, hi) if a != b]
    if differ:
        raise ValueError(f"data-parallel ranks disagree on {what}: " + "; ".join(differ))


def check_same_per_item(names: list[str], described: list[str], group, device: torch.device, what: str) -> None:
    """Raise ValueError on every rank unless every rank has the same `described[i]` for each item.

    One all-reduce of a CRC per item (and its negation): the first item that differs is named
    with this rank's description, e.g. a weight that is [4, 6] here and [6, 4] on another rank.
    Items must already agree in number (check that first).
    """
    if group is None or comm.group_size(group) == 1 or not names:
        return
    mine = [zlib.crc32(d.encode()) for d in described]
    t = torch.tensor(mine + [-v for v in mine], dtype=torch.int64, device=device)
    comm.all_reduce(t, group, kind="dp_all_reduce", name="agree", op=dist.ReduceOp.MAX, async_op=False)
    n = len(mine)
    hi, lo = t[:n].tolist(), [-v for v in t[n:].tolist()]
    differ = [i for i in range(n) if hi[i] != lo[i]]
    if differ:
        i = differ[0]
        more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
        raise ValueError(f"data-parallel ranks disagree on {what}: {names[i]} is {described[i]} on this rank "
                         f"(rank {dist.get_rank()}) and different on another{more}")


def raise_if_any(problem: str | None, group, device: torch.device) -> None:
    """Raise ValueError on every rank of `group` if any rank has a problem (its own text, or the ranks that had one)."""
    if group is None or comm.group_size(group) == 1:
        if problem is not None:
            raise ValueError(problem)
        return
    flags = torch.zeros(comm.group_size(group), dtype=torch.int64, device=device)
    flags[comm.group_rank(group)] = problem is not None
    comm.all_reduce(flags, group, kind="dp_all_reduce", name="agree", async_op=False)
    if problem is not None:
        raise ValueError(problem)
    bad = [r for r, f in enumerate(flags.tolist()) if f]
    if bad:
        raise ValueError(f"data-parallel rank(s) {bad} of the group rejected the input (their error says why)")


def copy_from_first_rank(tensors: list[torch.Tensor], group) -> None:
    """Overwrite `tensors` with group rank 0's values (a broadcast written as a sum with zeros elsewhere).

    Every dtype: bool tensors travel as uint8 (a sum of one 0/1 and zeros), complex ones as
    their real view.
    """
    if group is None or comm.group_size(group) == 1:
        return
    first = comm.group_rank(group) == 0
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # (bool tensor, its uint8 copy)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.dtype == torch.bool:
            u = t.to(torch.uint8)
            staged.append((t, u))
            t = u
        elif t.dtype.is_complex:
            t = torch.view_as_real(t)
        by_dtype.setdefault(t.dtype, []).append(t)
    for ts in by_dtype.values():
        if not first:
            with torch.no_grad():
                for t in ts:
                    t.zero_()
        comm.all_reduce_coalesced(ts, group, kind="dp_all_reduce", name="broadcast")
    with torch.no_grad():
        for t, u in staged:
            t.copy_(u.bool())
