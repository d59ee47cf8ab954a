"""A sharded (ZeRO-1/2) optimizer: gradient reduce-scatter overlaps backward, and the parameter
all-gather after the step overlaps the next forward.

Each rank steps fp32 masters and optimizer state for its shards only (the optimizer must be
elementwise); the updated shards are gathered back bucket by bucket right after `step()`, and
each module's forward pre-hook waits only for the buckets holding its own parameters (Megatron's
overlap_param_gather; any other read waits too, zero_guard.py). `overlap_param_gather=False` is
the sequential reference. Clip with `ShardedOptimizer.clip_grad_norm_`: `.grad` is complete only on
this rank's shard. docs/data_parallel.md has the layout and the rules.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from ..runtime import comm
from ..runtime.groups import resolve_group
from ..runtime.agreement import raise_explained
from ..runtime.deprecation import deprecated
from .agree import raise_if_any
from .ddp import DataParallel, DataParallelConfig, GradSync
from .zero_checkpoint import PerParameterCheckpoint
from .zero_guard import guard, lander, release


class ShardedOptimizer(PerParameterCheckpoint):
    """Steps `optimizer_cls(**opt_kwargs)` on this rank's shard of the parameters of a DataParallel.

    Pass the DataParallel (its group must be `dp_group`) for `overlap="bulk"` (the default: the
    parameter gathers hide behind the next forward), which hooks the forward of its modules. Plain
    parameters also work, with `overlap="none"`: their gradients are reduce-scattered in backward the
    same way. (`overlap_param_gather=True | False` is the earlier spelling, a DeprecationWarning once.)
    Under overlap="bulk", a read of a parameter before its own module's forward (another
    module borrowing it, an EMA copy after `step()`) waits for its gather (zero_guard.py says what
    that does and does not cover).
    Checkpoints: `state_dict()` per rank (torch.save, same world size), or
    `checkpoint_state_dict()` per parameter for torch.distributed.checkpoint (any size).
    """

    def __init__(self, params_or_dp: DataParallel | Iterable[nn.Parameter], optimizer_cls, dp_group, *,
                 overlap: str = "bulk", overlap_param_gather: bool | None = None, **opt_kwargs: Any) -> None:
        dp_group = resolve_group(dp_group, "dp")  # None: the default group, as in torch.distributed
        if overlap_param_gather is not None:
            deprecated("ShardedOptimizer(overlap_param_gather=...)", 'ShardedOptimizer(overlap="bulk" | "none")')
            if not isinstance(overlap_param_gather, bool):
                raise ValueError(f"ShardedOptimizer overlap_param_gather must be True or False, got {overlap_param_gather!r}")
            overlap = "bulk" if overlap_param_gather else "none"
        if overlap not in ("none", "bulk"):
            raise ValueError(f"ShardedOptimizer overlap={overlap!r} is not one of ('none', 'bulk')")
        overlap_param_gather = overlap == "bulk"
        if isinstance(params_or_dp, DataParallel):
            if params_or_dp.group is not dp_group:
                raise ValueError("ShardedOptimizer dp_group is not the group of the DataParallel it shards")
            # The parameters become views of one flat buffer below: plain local tensors.
            params_or_dp.localize_for_flat_parameters()
            self.sync, module = params_or_dp.sync, params_or_dp.module
        else:
            if overlap_param_gather:
                raise ValueError("ShardedOptimizer overlap='bulk' waits for each bucket's gather in "
                                 "forward pre-hooks of the modules that use it: pass the DataParallel, not "
                                 "parameters (or set overlap='none')")
            named = [(f"params[{i}]", p) for i, p in enumerate(params_or_dp) if p.requires_grad]
            self.sync, module = GradSync(named, dp_group, DataParallelConfig(bucket_mb=25.0)), None
        self.group, self.overlap_param_gather = dp_group, overlap_param_gather
        self.world, self.rank = self.sync.world, self.sync.rank
        self._grad_shards = self.sync.shard_gradients()
        buf = self.sync.buffer
        self._param_data = torch.zeros_like(buf.data)
        with torch.no_grad():
            for p in self.sync.params:
                view = buf.view(p, self._param_data)
                view.copy_(p)
                p.data = view
        self._ranges = [b.shard(self.rank, self.world) for b in buf.buckets]
        # fp32 parameters are their own master: a write into them (a model load_state_dict, an
        # in-place DCP load) is what the next step starts from. Other dtypes keep an fp32 copy.
        self._own_master = buf.dtype != torch.float32
        self.master = [nn.Parameter(torch.empty(hi - lo, dtype=torch.float32, device=buf.device)
                                    .copy_(self._param_data[lo:hi]) if self._own_master
                                    else self._param_data[lo:hi]) for lo, hi in self._ranges]
        self.optimizer = optimizer_cls(self.master, **opt_kwargs)
        # What the last gather sent; a parameter shard that differs from it was written since.
        self._gather_src = [self._param_data[lo:hi].clone() for lo, hi in self._ranges]
        self._module = module
        self._checkpoint_layout: dict | None = None
        self._gathers: dict[int, comm.Handle] = {}
        # Per bucket, the parameters whose reads wait for its gather while it is in flight, and
        # whether every one can (a plain nn.Parameter; another subclass keeps its own class and
        # its bucket is waited for in step() instead).
        self._guarded = [list(b.params) for b in buf.buckets]
        self._guardable = [all(type(p) is nn.Parameter for p in b.params) for b in buf.buckets]
        self._landers = [lander(self._wait_buckets, b) for b in range(len(buf.buckets))]
        self._hooks = []
        if module is not None:
            if overlap_param_gather:
                for m in module.modules():
                    mine = sorted({buf.bucket_of(p) for p in m.parameters(recurse=False) if p in self.sync.slot})
                    if mine:
                        self._hooks.append(m.register_forward_pre_hook(
                            lambda _m, _args, mine=mine: self._wait_buckets(mine)))
            # Reading the parameters must not race with a gather still landing in them.
            register = getattr(module, "register_state_dict_pre_hook", None)
            if register is not None:
                self._hooks.append(register(lambda *_: self.finish_param_gather()))

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's param groups (learning rate etc.); its params are the master shards."""
        return self.optimizer.param_groups

    # -- step ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """Step the master shards with the reduced gradient shards, then gather the parameters."""
        self.finish_param_gather()
        if self.sync.progress is not None:
            self.sync.progress.check_backward_since_step("ShardedOptimizer.step()")
        if self._own_master:
            self._refresh_written_masters()
        for m, g in zip(self.master, self._grad_shards):
            m.grad = g if g.dtype == torch.float32 else g.float()
        self.optimizer.step()
        if self.sync.progress is not None:
            self.sync.progress.count_step()  # its inner optimizer steps master shards, not the model's parameters
        self._start_param_gather()
        if not self.overlap_param_gather:
            self.finish_param_gather()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the reduced gradient shards so that their norm over ALL ranks is at most `max_norm`.

        Returns that total norm (as `torch.nn.utils.clip_grad_norm_` does for one process).
        Collective: every rank of the group calls it, after backward and before `step()`.
        torch's own clip_grad_norm_ on the parameters would be wrong here: each rank's `.grad`
        holds the averaged gradient only on its own shard.
        """
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not 0 <= max_norm < math.inf:
            raise ValueError(f"ShardedOptimizer.clip_grad_norm_ max_norm must be a finite number >= 0, got {max_norm!r}")
        p = float(norm_type)
        if not p > 0:
            raise ValueError(f"ShardedOptimizer.clip_grad_norm_ norm_type must be > 0 or inf, got {norm_type!r}")
        shards = [g.float() for g in self._grad_shards]
        if p == math.inf:
            local = torch.stack([g.abs().max() for g in shards]).max()
            op = dist.ReduceOp.MAX
        else:
            local = torch.stack([g.abs().pow(p).sum() for g in shards]).sum()
            op = dist.ReduceOp.SUM
        if self.group is not None:
            comm.all_reduce(local, self.group, kind="dp_all_reduce", name="grad-norm", op=op, async_op=False)
        total = local if p == math.inf else local.pow(1.0 / p)
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        buf = self.sync.buffer
        for g, (lo, hi) in zip(self._grad_shards, self._ranges):
            g.mul_(coef.to(g.dtype))
            buf.data[lo:hi].copy_(g)  # keep .grad on this rank's shard the same as what step() uses
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffer in place (the `.grad` views stay; set_to_none is ignored on purpose)."""
        self.sync.buffer.zero_()

    @torch.no_grad()
    def _refresh_written_masters(self) -> None:
        # Parameters written since the last gather (a model load, an in-place DCP load) win over
        # the fp32 master, which would otherwise put the old weights back at this step.
        for m, src, (lo, hi) in zip(self.master, self._gather_src, self._ranges):
            if not torch.equal(self._param_data[lo:hi], src):
                m.copy_(self._param_data[lo:hi])

    def _start_param_gather(self) -> None:
        buf = self.sync.buffer
        for b in reversed(range(len(buf.buckets))):  # forward order: the first layers are needed first
            self._gather_src[b].copy_(self.master[b])
            bucket = buf.buckets[b]
            out = self._param_data[bucket.offset:bucket.offset + bucket.numel]
            if self.group is None:
                out.copy_(self._gather_src[b])
                continue
            self._gathers[b] = comm.all_gather(out, self._gather_src[b], self.group,
                                               kind="zero_all_gather", name=f"bucket{b}")
        if self.overlap_param_gather:
            unguarded = [b for b in self._gathers if not self._guardable[b]]
            self._wait_buckets(unguarded)
            for b in self._gathers:
                guard(self._guarded[b], self._landers[b])

    def _wait_buckets(self, buckets: list[int]) -> None:
        for b in buckets:
            h = self._gathers.pop(b, None)
            if h is not None:
                try:
                    h.wait()
                except Exception as e:  # noqa: BLE001 - a peer that broke step may have said why
                    raise_explained(self.group, "ShardedOptimizer", e, f"the parameter gather of bucket {b}")
                finally:
                    release(self._guarded[b])

    def finish_param_gather(self) -> None:
        """Wait for every parameter gather still in flight (before reading parameters outside forward)."""
        self._wait_buckets(sorted(self._gathers))

    # -- checkpoint --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's shard: master values and optimizer state, with the layout they belong to.

        For `torch.save` per rank and a reload at the same world size. Not for
        torch.distributed.checkpoint, which would take its plain tensors for replicated ones
        (`load_state_dict` then refuses the result on every rank): use `checkpoint_state_dict`.
        """
        self.finish_param_gather()
        return {"world_size": self.world, "rank": self.rank,
                "shard_numels": [hi - lo for lo, hi in self._ranges],
                "master": [m.detach().clone() for m in self.master],
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Load this rank's shard saved by `state_dict` at the same world size; then gather the parameters.

        Collective: every rank of the group calls it. A mismatch on any rank fails on all.
        """
        mine = {"world_size": self.world, "rank": self.rank, "shard_numels": [hi - lo for lo, hi in self._ranges]}
        wrong = [f"{k}={state.get(k)!r} (expected {v!r})" for k, v in mine.items() if state.get(k) != v]
        problem = f"ShardedOptimizer state does not fit this layout: {', '.join(wrong)}" if wrong else None
        raise_if_any(problem, self.group, self.sync.buffer.device)
        self.finish_param_gather()
        with torch.no_grad():
            for m, saved in zip(self.master, state["master"]):
                m.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self._start_param_gather()
        self.finish_param_gather()
