"""Parameters shared by several modules (tied weights) stay one parameter through a plan, or are refused.

Nothing here overlaps anything. A plan's styles replace each module's parameters one module at
a time, so an embedding tied to the output head would come out as two shards that train apart
(silently: both still get gradients). `find_tied` lists the shared parameters before the plan
is applied; `check_tied_plan` refuses, before anything is sliced, a plan that would split the
members differently (naming them and the styles); `retie` makes the members one parameter
again afterwards, and refuses if the shards it finds are not the same slice of the same tensor.
"""

from __future__ import annotations

from fnmatch import fnmatch

import torch
from torch import nn


def find_tied(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that are one Parameter object (each group of two or more)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _style_of(plan: dict, module_path: str):
    tokens = module_path.split(".")
    for key, style in plan.items():
        parts = key.split(".")
        if len(parts) == len(tokens) and all(fnmatch(a, b) for a, b in zip(tokens, parts)):
            return style
    return None


def _split(style, param_name: str) -> str:
    """How a style leaves a parameter: 'rows' (Shard(0)), 'columns' (Shard(1)) or 'whole'."""
    from ..tensor_parallel.styles import ColwiseParallel, RowwiseParallel, VocabParallel

    if isinstance(style, (ColwiseParallel, VocabParallel)):
        return "rows"
    if isinstance(style, RowwiseParallel):
        return "columns" if param_name == "weight" else "whole"
    return "whole"


def check_tied_plan(plan: dict, tied: list[list[str]]) -> None:
    """Refuse a plan that would split the members of a tied group differently (before slicing)."""
    for names in tied:
        splits = {}
        for name in names:
            module, _, pname = name.rpartition(".")
            style = _style_of(plan, module)
            splits[name] = (_split(style, pname), type(style).__name__ if style is not None else "no style")
        if len({s for s, _ in splits.values()}) > 1:
            found = ", ".join(f"{n} ({how} by {style})" for n, (how, style) in splits.items())
            raise ValueError(f"parallelize: {names} are one tied parameter, but the plan would split them "
                             f"differently: {found}; give them styles that split alike (VocabParallel and "
                             "ColwiseParallel both split rows) or untie them first")


def _get(model: nn.Module, name: str) -> torch.Tensor:
    module, _, pname = name.rpartition(".")
    return getattr(model.get_submodule(module) if module else model, pname)


def retie(model: nn.Module, tied: list[list[str]]) -> None:
    """Make every tied group one parameter again (the first member's), or raise naming the group."""
    for names in tied:
        first = _get(model, names[0])
        for name in names[1:]:
            p = _get(model, name)
            if p is first:
                continue
            same = (type(p) is type(first) and p.shape == first.shape and p.dtype == first.dtype
                    and getattr(p, "placements", None) == getattr(first, "placements", None)
                    and getattr(p, "device_mesh", None) == getattr(first, "device_mesh", None))
            local = (lambda t: t._local_tensor if hasattr(t, "_local_tensor") else t.data)
            if not same or not torch.equal(local(p), local(first)):
                raise ValueError(f"parallelize: {names[0]} and {name} were one tied parameter and came out of the "
                                 f"plan as different shards ({getattr(first, 'placements', 'whole')} vs "
                                 f"{getattr(p, 'placements', 'whole')}); untie them first or split them alike")
            module, _, pname = name.rpartition(".")
            setattr(model.get_submodule(module) if module else model, pname, first)
