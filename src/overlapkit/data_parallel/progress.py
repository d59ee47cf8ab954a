"""Data-parallel ranks compare how far they are, at every training forward, before its first collective.

Nothing here overlaps anything. A rank that skipped `backward()` or `optimizer.step()` breaks
step with its replicas: its next gradient reduction would pair with the others' previous one (a
result averaged over two different steps, silently), or its parameters stay behind and the
replicas drift apart for good. `Progress.before_forward` puts this rank's counts — backward
passes reduced, optimizer steps taken over the engine's parameters — into the entry check's one
tiny all-gather (runtime/entry.py), and every `digest_every` forwards a digest of the parameters
too, so replicas that drifted apart any other way (a rank that changed its weights by hand) are
named as well. A rank that is still waiting inside the previous step's collectives when a peer
checks its next forward is named by where each waits (agreement.raise_explained).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..runtime import state
from ..runtime.agreement import RankMismatchError, report_problem
from ..runtime.entry import check_device, check_inputs

DIGEST_EVERY = 100
"""Forwards between two digests of the parameters (replicas only): one pass over the parameters
(a fused norm per parameter) every that many steps; its cost is in docs/reliability.md."""

HINT = ("a rank whose count is behind skipped backward() or optimizer.step() (or ran an extra one); a parameter "
        "digest that differs means the replicas no longer hold the same weights")


_STEP_HOOK: dict = state.cache_dict("data_parallel.progress_step_hook")
"""The one optimizer-step hook of this process and the Progress objects it counts steps for."""


def _stepped(live, optimizer) -> None:
    first = [g["params"][0] for g in optimizer.param_groups if g["params"]]
    for progress in list(live):
        if any(id(p) in progress.ids for p in first):
            progress.steps += 1


class Progress:
    """This rank's backward passes and optimizer steps over `params`, compared across `group` each forward."""

    def __init__(self, params, group, what: str, *, replicas: bool = True) -> None:
        self.group, self.what, self.replicas = group, what, replicas
        self.backwards = 0
        self.steps = 0
        self.forwards = 0
        self._backwards_at_step = -1
        self._zeros: torch.Tensor | None = None
        self.digest_every = DIGEST_EVERY
        """Forwards between parameter digests (0: never); replicas only (a sharded model's shards differ)."""
        self.params = [p for p in params]
        self.ids = {id(p) for p in self.params}
        if "live" not in _STEP_HOOK:
            # One process-wide hook (a hook removed while torch iterates its hooks breaks that step).
            live = _STEP_HOOK["live"] = weakref.WeakSet()
            _STEP_HOOK["handle"] = register_optimizer_step_post_hook(lambda opt, _a, _k: _stepped(live, opt))
        _STEP_HOOK["live"].add(self)

    def count_step(self) -> None:
        """An engine's own optimizer (ShardedOptimizer) says it stepped."""
        self.steps += 1
        self._backwards_at_step = self.backwards

    def check_backward_since_step(self, what: str) -> None:
        """Raise (said on the store first, for the peers waiting in the reduction) if no reduced
        backward ran since the last step: this rank skipped backward(), the others wait in its reduction."""
        if self.backwards > self._backwards_at_step:
            return
        text = (f"{what} on rank {dist.get_rank()} without a backward() since its last step: this rank skipped "
                "backward(), and the other ranks wait in that backward's gradient reduction")
        report_problem(self.group, self.what, text)
        raise RankMismatchError(text)

    def before_forward(self, training: bool, defer: bool = False):
        """Compare the counts (and, every `digest_every` forwards, the parameters) across the group.
        `defer`: post the comparison and return the function that completes it (runtime.entry.check_inputs)."""
        if not training or not torch.is_grad_enabled():
            return  # an evaluation forward (perhaps on one rank only) issues no data-parallel collective
        if self.group is None or not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return  # one replica (a world of one, perhaps without torch.distributed): nothing to compare with
        self.forwards += 1
        extra = None
        if self.replicas:
            # The same length every forward (a gather of unequal sizes aborts gloo): zeros between digests.
            due = self.digest_every and self.forwards % self.digest_every == 0
            if due:
                extra = self._digest()
            else:
                if self._zeros is None:  # made once on the check's device: no copy to it each step
                    self._zeros = torch.zeros(2, dtype=torch.int64, device=check_device(self.group))
                extra = self._zeros
        return check_inputs(self.group, self.what, same_values=False, hint=HINT, extra=extra, defer=defer,
                            counters={"backward passes": self.backwards, "optimizer steps": self.steps})

    def _digest(self) -> torch.Tensor:
        # Replicas hold bitwise-equal weights and run the same kernels: their norms are equal bit for bit.
        tensors = [p.to_local() if hasattr(p, "to_local") else p for p in self.params]
        with torch.no_grad():
            norms = torch.stack(torch._foreach_norm([t.detach() for t in tensors])).double()
            weights = torch.arange(1, norms.numel() + 1, dtype=torch.float64, device=norms.device)
            return torch.stack([norms.sum(), (norms * weights).sum()]).view(torch.int64)
