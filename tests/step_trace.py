"""For the tests of an `auto` that has decided: one step of a module, traced for comparison with its twin pinned at
what auto chose — the aten ops in order (with their tensor arguments' shapes), the collectives in issue order, the
hooks registered on every submodule, and the tensors the module's objects hold (count and bytes). Two modules
that trace alike run the same calls and keep the same memory; what differs names the residue."""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from overlapkit.timeline import record

FOLLOWED = ("overlapkit", "torch.distributed.fsdp", "torch.nn.modules")
"""Objects whose attributes the walk for held tensors follows (beside containers): the module's own state,
FSDP2's, overlapkit's; not functions or process groups, which lead to the whole process."""


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shapes = tuple(tuple(a.shape) for a in torch.utils._pytree.tree_leaves((args, kwargs))
                       if isinstance(a, torch.Tensor))
        self.ops.append((str(func), shapes))
        return func(*args, **(kwargs or {}))


def hooks(module: nn.Module) -> dict:
    """Per submodule: its forward-pre, forward, backward and backward-pre hook counts."""
    return {n: tuple(len(h) for h in (m._forward_pre_hooks, m._forward_hooks, m._backward_hooks,
                                      m._backward_pre_hooks)) for n, m in module.named_modules()}


def held_tensors(root) -> tuple[int, int, list[str]]:
    """(tensors, bytes of their distinct storages, where each is held) reachable from `root` through containers
    and the attributes of overlapkit's, FSDP2's and nn's objects."""
    seen, stack, storages, where = set(), [(root, "")], {}, []
    while stack:
        obj, path = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            where.append(f"{path} {tuple(obj.shape)}")
            local = obj.to_local() if hasattr(obj, "to_local") else obj
            s = local.untyped_storage()
            storages[(s.data_ptr(), s.nbytes())] = s.nbytes()
            if obj.is_leaf and obj.grad is not None:
                stack.append((obj.grad, path + ".grad"))
            continue
        if isinstance(obj, dict):
            stack += [(k, f"{path}[key]") for k in obj] + [(v, f"{path}[{k!r}]"[:120]) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack += [(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        elif type(obj).__module__.startswith(FOLLOWED) or isinstance(obj, nn.Module):
            stack += [(v, f"{path}.{k}") for k, v in getattr(obj, "__dict__", {}).items()]
            stack += [(getattr(obj, k, None), f"{path}.{k}") for k in getattr(type(obj), "__slots__", ())]
            if isinstance(obj, nn.Module) and hasattr(obj, "_get_fsdp_state"):  # FSDP2 keeps it beside the module
                stack.append((obj._get_fsdp_state(), f"{path}<fsdp state>"))
    return len(where), sum(storages.values()), sorted(where)


def step_trace(module, step) -> dict:
    """Run `step()` (one training step of `module`) once, traced; see the module docstring."""
    mode = _Ops()
    with record() as rec:
        rec.next_step()
        with mode:
            step()
    comms = [(s.kind, s.name) for s in sorted(rec.spans, key=lambda s: s.start_ms) if not s.is_compute]
    count, nbytes, where = held_tensors(module)
    return {"ops": mode.ops, "comms": comms, "hooks": hooks(module), "held": (count, nbytes), "held where": where}


def differences(a: dict, b: dict) -> dict:
    """What differs between two traces: per key, a short account (empty when they are the same)."""
    out = {}
    for key in a:
        if a[key] == b[key]:
            continue
        if key in ("ops", "held where"):
            ca, cb = Counter(a[key]), Counter(b[key])
            out[key] = {"only here": dict(ca - cb), "only there": dict(cb - ca), "lengths": (len(a[key]), len(b[key]))}
        else:
            out[key] = (a[key], b[key])
    return out
