"""ShardedOptimizer's state per parameter, for torch.distributed.checkpoint (DCP): saved, loaded, resharded.

Nothing here overlaps anything. A ShardedOptimizer steps flat shards of buckets, so its own
per-rank state would look replicated to DCP, which keeps one copy: every rank would reload one
rank's shard. Here each parameter's state becomes what DCP understands, in torch's FQN-keyed
layout (`get_optimizer_state_dict`): a DTensor `Shard(0)` over the data-parallel group for a
plain parameter, a DTensor with the parameter's own TP placements for a TP layer's parameter.
Saving gathers each bucket's shards once and cuts the parameters out of it; loading takes each
parameter's whole (TP-local) value and keeps this rank's part of the flat shard. DCP does the
resharding: another data-parallel size, another TP size, or a plain single-process optimizer.
"""

from __future__ import annotations

import torch
from torch import nn

from ..runtime import comm
from .agree import raise_if_any


class PerParameterCheckpoint:
    """Mixin of ShardedOptimizer: `checkpoint_state_dict` / `load_checkpoint_state_dict`.

    Uses its sync (GradSync), group, optimizer, master, _ranges, _param_data, _module,
    _own_master and its gather methods.
    """

    def checkpoint_state_dict(self) -> dict:
        """The optimizer state per parameter, for torch.distributed.checkpoint: saves, loads, reshards.

        torch's FQN-keyed layout (that of `get_optimizer_state_dict`): `{"state": {fqn: {name:
        value}}, "param_groups": [{..., "params": [fqn, ...]}]}`, the FQNs those of the module
        the DataParallel wraps. A parameter's elementwise state is a DTensor `Shard(0)` on the
        data-parallel group (a TP parameter's: a DTensor with the parameter's own TP placements,
        whole on each data-parallel rank); scalars (Adam's step) are plain. So DCP can load it at
        another data-parallel or TP size, or into a plain torch optimizer (`set_optimizer_state_dict`).
        Non-fp32 parameters add their fp32 master as the state named "master".
        Collective over the data-parallel group (one all-gather per bucket and state).
        """
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

        self.finish_param_gather()
        _init_optim_state(self.optimizer)
        layout, mesh = self._layout(), self._dp_mesh()
        state: dict[str, dict] = {}
        for b, (lo, hi) in enumerate(self._ranges):
            bucket = self.sync.buffer.buckets[b]
            for key, value in self._bucket_state(b).items():
                full = value if _elementwise(value, hi - lo) else None
                if full is not None and self.group is not None:  # the whole bucket's worth of this state
                    full = torch.empty(bucket.numel, dtype=value.dtype, device=value.device)
                    comm.all_gather(full, value.contiguous(), self.group, kind="zero_all_gather",
                                    name=f"checkpoint.bucket{b}.{key}", async_op=False)
                for p in bucket.params:
                    fqn, tp = layout[p]
                    if full is None:
                        state.setdefault(fqn, {})[key] = value.clone() if torch.is_tensor(value) else value
                        continue
                    offset = self.sync.buffer.view(p, self._param_data).storage_offset() - bucket.offset
                    mine = full[offset:offset + p.numel()].view(p.shape).clone()
                    if tp is not None:  # whole on every data-parallel rank; DCP keeps one copy
                        mesh_tp, placements, shape, stride = tp
                        mine = DTensor.from_local(mine, mesh_tp, placements, run_check=False, shape=shape,
                                                  stride=stride)
                    elif mesh is not None:
                        placement = [Shard(0) if p.dim() else Replicate()]
                        local = distribute_tensor(mine, mesh, placement, src_data_rank=None).to_local().clone()
                        mine = DTensor.from_local(local, mesh, placement, run_check=False,
                                                  shape=mine.shape, stride=mine.stride())
                    state.setdefault(fqn, {})[key] = mine
        fqns = [layout[p][0] for p in self._checkpoint_order]
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": fqns}
                  for g in self.optimizer.param_groups]
        return {"state": state, "param_groups": groups}

    def load_checkpoint_state_dict(self, state_dict: dict) -> None:
        """Load what `checkpoint_state_dict` gave (after `dcp.load` into it), or a plain torch optimizer's.

        Any data-parallel size, and any TP size that DCP resharded the TP states to; plain
        full tensors work too (torch's `get_optimizer_state_dict` of a single-process model).
        Without a "master" state, a non-fp32 parameter's master is its current value: load the
        model first. Collective; a problem on any rank fails on all, before anything changes.
        """
        self.finish_param_gather()
        _init_optim_state(self.optimizer)
        layout = self._layout()
        state, groups = state_dict.get("state"), state_dict.get("param_groups")
        if not isinstance(state, dict) or not isinstance(groups, list) or not groups:
            problem = ("ShardedOptimizer.load_checkpoint_state_dict takes {'state': {fqn: ...}, 'param_groups': "
                       f"[...]}} (from checkpoint_state_dict); got keys {sorted(state_dict)}")
        else:
            problem = self._checkpoint_problem(state, groups)
        raise_if_any(problem, self.group, self.sync.buffer.device)
        if self._own_master:  # a model loaded in place since the last gather: its values, unless a master comes
            self._refresh_written_masters()
        for g in self.optimizer.param_groups:
            g.update({k: v for k, v in groups[0].items() if k != "params"})
        with torch.no_grad():
            for b, (lo, hi) in enumerate(self._ranges):
                bucket = self.sync.buffer.buckets[b]
                for key, value in self._bucket_state(b).items():
                    saved = [state[layout[p][0]].get(key) for p in bucket.params]
                    if saved[0] is None:  # only "master" may be absent
                        continue
                    if not _elementwise(value, hi - lo):
                        if torch.is_tensor(value):
                            value.copy_(saved[0])
                        else:
                            self.optimizer.state[self.master[b]][key] = saved[0]
                        continue
                    for p, v in zip(bucket.params, saved):
                        start = self.sync.buffer.view(p, self._param_data).storage_offset()
                        first, end = max(start, lo), min(start + p.numel(), hi)
                        mine = self._local_state(p, v).reshape(-1)  # collective: every rank, every parameter
                        if first < end:
                            value[first - lo:end - lo].copy_(mine[first - start:end - start])
        self._start_param_gather()
        self.finish_param_gather()

    def _checkpoint_problem(self, state: dict, groups: list) -> str | None:
        """What keeps `state` from loading here (checked on every rank before any transfer), or None."""
        layout = self._layout()
        missing = [fqn for fqn, _ in layout.values() if fqn not in state]
        if missing:
            return f"ShardedOptimizer checkpoint has no state for parameters {missing[:4]}"
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        if any(h != hyper[0] for h in hyper):
            return (f"ShardedOptimizer steps one param group; the checkpoint has {len(groups)} with different "
                    "options: load it into a torch optimizer with as many groups instead")
        for b, (lo, hi) in enumerate(self._ranges):
            bucket = self.sync.buffer.buckets[b]
            for key, value in self._bucket_state(b).items():
                saved = [state[layout[p][0]].get(key) for p in bucket.params]
                absent = [layout[p][0] for p, v in zip(bucket.params, saved) if v is None]
                if absent and (key != "master" or len(absent) < len(saved)):
                    return f"ShardedOptimizer checkpoint: parameters {absent[:4]} have no state {key!r}"
                if absent:
                    continue
                if _elementwise(value, hi - lo):
                    wrong = [f"{layout[p][0]}: {tuple(v.shape)} (expected {self._full_shape(p)})"
                             for p, v in zip(bucket.params, saved) if tuple(v.shape) != self._full_shape(p)]
                    if wrong:
                        return f"ShardedOptimizer checkpoint: state {key!r} has the wrong shape: {', '.join(wrong[:4])}"
                elif any(not _same(v, saved[0]) for v in saved):
                    return (f"ShardedOptimizer checkpoint: {key!r} differs between parameters "
                            f"{[layout[p][0] for p in bucket.params]}, which this optimizer steps as one tensor")
        return None

    def _local_state(self, p: nn.Parameter, value) -> torch.Tensor:
        """This rank's whole parameter's worth (its TP shard for a TP parameter) of a loaded state."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        tp = self._layout()[p][1]
        if tp is not None and isinstance(value, DTensor) and value.device_mesh == tp[0]:
            return value.redistribute(tp[0], tp[1]).to_local()
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if tp is None:
            return full
        return distribute_tensor(full, tp[0], tp[1], src_data_rank=None).to_local()

    def _full_shape(self, p: nn.Parameter) -> tuple:
        """The parameter's shape in the model (a TP parameter's global shape, not its shard's)."""
        tp = self._layout()[p][1]
        return tuple(p.shape) if tp is None else tuple(tp[2])

    def _bucket_state(self, b: int) -> dict:
        """The inner optimizer's state of bucket b's shard, with the fp32 master when it has its own."""
        inner = self.optimizer.state[self.master[b]]
        return {**inner, "master": self.master[b].data} if self._own_master else inner

    def _layout(self) -> dict:
        """parameter -> (its FQN, None when plain, or (mesh, placements, shape, stride) of its TP DTensor).

        The TP facts come from the module's own state_dict: what DCP sees for the weight is what
        its optimizer state is saved as. Parameters of a ShardedOptimizer built from plain
        parameters are named `params[i]` and have no TP facts.
        """
        if self._checkpoint_layout is None:
            from torch.distributed.tensor import DTensor

            if self._module is None:
                named, sd = list(self.sync.named), {}
            else:
                named = [(n, p) for n, p in self._module.named_parameters() if p in self.sync.slot]
                sd = self._module.state_dict(keep_vars=True)
                missing = [n for n, _ in named if n not in sd]
                if missing:
                    raise ValueError(f"ShardedOptimizer: parameters {missing[:4]} are not in the module's state_dict "
                                     "under their names, so their optimizer state has no key to be saved under")
            tp = {n: (v.device_mesh, tuple(v.placements), v.shape, v.stride())
                  for n, v in sd.items() if isinstance(v, DTensor)}
            self._checkpoint_layout = {p: (n, tp.get(n)) for n, p in named}
            self._checkpoint_order = [p for _, p in named]
        return self._checkpoint_layout

    def _dp_mesh(self):
        """A 1-D DeviceMesh over the data-parallel group (None for a world of one without torch.distributed)."""
        if self.group is None:
            return None
        if getattr(self, "_mesh", None) is None:
            from torch.distributed.device_mesh import DeviceMesh

            self._mesh = DeviceMesh.from_group(self.group, self.sync.buffer.device.type)
        return self._mesh


def _elementwise(value, numel: int) -> bool:
    """A state with one value per element of the shard (Adam's moments), not a scalar (its step)."""
    return torch.is_tensor(value) and tuple(value.shape) == (numel,)


def _same(a, b) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    return a == b


def _init_optim_state(optimizer) -> None:
    """torch's own: create a lazily built optimizer state by a step with zero gradients at lr 0."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state as init

    init(optimizer)
