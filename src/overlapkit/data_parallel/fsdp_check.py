"""What `fully_shard` checks at each forward so that ranks never pair unrelated collectives.

Nothing here overlaps anything. FSDP2 issues a block's gather when the block's forward starts
(or earlier, prefetched) and its reduce-scatter in backward, and every rank must issue the same
ones in the same order: a rank that ran another block, or froze a parameter the others did
not (its reduce-scatter is smaller), pairs with a collective of another size or meaning, and
gloo then aborts the process or times out with no word of what happened. So, before FSDP2
issues anything for a forward:

- the model is as it was when sharded (watch.py: no parameter added or replaced, the same
  dtypes, and the same `requires_grad`): checked at the root's pre-forward;
- each block runs in the order of the forward before (the first forward: registration
  order, the order prefetch assumes): checked at each block's pre-forward, before FSDP2's.

Both are local, cheap and silent while nothing changes. A rank that finds a change leaves its
reason on the store (`report_problem`) and compares it with the other ranks (one store round
trip): if every rank changed the same way and FSDP2 handles it (the same parameters frozen on
every rank, the same blocks skipped), training goes on; otherwise it raises, and a rank left
waiting in a collective names this rank and its reason when its own wait fails (at the latest
after the group's timeout).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime.agreement import RankMismatchError, exchange, report_problem

ADVICE = ("FSDP2 shards the parameters the model had when fully_shard ran and every rank must issue the same "
          "gathers and reduce-scatters: add, replace, move or cast parameters before fully_shard, and change "
          "requires_grad on every rank alike")


class StepCheck:
    """The model and block-order checks of one `fully_shard` model (see the module docstring)."""

    def __init__(self, watch, names: list[str], group) -> None:
        self.watch, self.names, self.group = watch, names, group
        self.previous: list[int] = list(range(len(names)))
        self.now: list[int] = []
        self.agreed_new_order = False

    # -- the model ---------------------------------------------------------------------------
    def model(self) -> None:
        """At the root's pre-forward: raise (or agree with every rank) if the model changed since sharding."""
        problem = self.watch.problem()
        if problem is None:
            return
        same = self._compare(problem)
        if same and self.watch.changed_requires_grad_only():
            self.watch.accept()  # the same freeze on every rank: FSDP2 reduces what requires a gradient
            return
        raise ValueError(problem)

    # -- the blocks --------------------------------------------------------------------------
    def forward_starts(self) -> None:
        self.now, self.agreed_new_order = [], False

    def block(self, i: int) -> None:
        """At block i's pre-forward, before FSDP2's: is it the block the forward before ran at this position?"""
        if torch._C._current_graph_task_id() != -1:
            return  # recomputed in backward (activation checkpointing): not a forward of its own
        k = len(self.now)
        self.now.append(i)
        if self.agreed_new_order:
            return
        prev = self.previous
        if k < len(prev) and prev[k] == i:
            return
        was = self.names[prev[k]] if k < len(prev) else "no block (it had run all it runs)"
        skipped = self.names[prev[k]] if k < len(prev) and i in prev[k + 1:] else None
        self._order_changed(f"{self.names[i]} ran as block #{k} of the forward, where the forward before ran {was}"
                            + (f" ({skipped} was skipped)" if skipped else ""))

    def forward_ends(self) -> None:
        if torch._C._current_graph_task_id() != -1:
            return
        prev, now = self.previous, self.now
        if not self.agreed_new_order and len(now) < len(prev):
            missing = [self.names[j] for j in prev[len(now):]]
            self._order_changed(f"the forward ended after {len(now)} blocks, where the forward before also ran "
                                f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
        self.previous = now

    def _order_changed(self, what: str) -> None:
        problem = f"fully_shard: the blocks ran in another order than in the forward before: {what}"
        if not self._compare(problem):
            raise ValueError(problem)  # unreachable: _compare raises when the ranks differ
        self.agreed_new_order = True  # every rank changed alike: the rest of this forward is compared at its end

    # -- across ranks --------------------------------------------------------------------------
    def _compare(self, problem: str) -> bool:
        """Tell the other ranks, then compare with them: True if every rank has the same change."""
        if self.group is None or dist.get_world_size(self.group) == 1:
            return True
        report_problem(self.group, "fully_shard", problem)
        ranks = dist.get_process_group_ranks(self.group)
        try:
            theirs = [t["change"] for t in exchange(self.group, "fully_shard", {"change": problem})]
        except RankMismatchError:
            raise RankMismatchError(
                f"{problem} (on this rank, rank {dist.get_rank()}; the other ranks of {ranks} did not change alike: "
                "they went on as before and wait for collectives this rank will not issue)") from None
        if all(t == theirs[0] for t in theirs):
            return True
        told = "; ".join(f"rank {r}: {t.removeprefix('fully_shard: ')}" for r, t in zip(ranks, theirs))
        raise RankMismatchError(f"fully_shard: the ranks {ranks} changed differently: {told}")
