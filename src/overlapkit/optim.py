"""Parameter groups that torch's foreach and fused optimizer kernels accept for a tensor-parallel model.

Nothing here overlaps anything. A model made tensor parallel holds DTensor parameters (the TP
layers) beside plain ones (norms, embeddings outside the plan); torch's `foreach` kernels (the
default on CUDA) and `fused=True` refuse one list holding both ("got mixed torch.Tensor and
DTensor"). torch groups an optimizer's tensors by device and dtype, never by tensor type, so
the fix is the parameter groups: each one here holds only plain tensors or only DTensors of one
device mesh, and every group carries the options it came with.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn


def _kind(p: torch.Tensor):
    """Plain tensors share one kind; DTensors one per device mesh (a foreach list spans one mesh)."""
    from torch.distributed.tensor import DTensor

    return ("dtensor", p.device_mesh) if isinstance(p, DTensor) else ("plain",)


def optim_param_groups(params: nn.Module | Iterable[torch.Tensor] | Iterable[dict], **group_options: Any) -> list[dict]:
    """Split `params` into optimizer param groups that are each all plain or all DTensor on one mesh.

    `params`: a module (its `parameters()`), parameters, or param groups (dicts with "params"
    and their own options). `group_options` (lr, weight_decay, ...) go into every group; a
    param group's own options win over them. Order is kept: the groups of one input group come
    in the order their first parameter appears. Use it as
    `torch.optim.AdamW(optim_param_groups(model), lr=1e-3, foreach=True)`. The optimizer's
    `zero_grad(set_to_none=False)` still mixes the kinds (one foreach call over all groups):
    keep its default (set to None) or call `model.zero_grad(set_to_none=False)`.
    """
    if isinstance(params, nn.Module):
        params = params.parameters()
    if isinstance(params, torch.Tensor):
        raise TypeError("optim_param_groups: params must be a module, an iterable of tensors or of param groups, "
                        "not a single tensor (as for torch.optim optimizers)")
    given = list(params)
    if not given:
        raise ValueError("optim_param_groups: got no parameters")
    if all(isinstance(g, dict) for g in given):
        groups = given
    elif any(isinstance(g, dict) for g in given):
        raise TypeError("optim_param_groups: params mixes param groups (dicts) and tensors; pass one or the other")
    else:
        groups = [{"params": given}]
    out: list[dict] = []
    for i, group in enumerate(groups):
        if "params" not in group:
            raise ValueError(f"optim_param_groups: param group {i} has no 'params' key (keys: {sorted(group)})")
        members = group["params"]
        members = [members] if isinstance(members, torch.Tensor) else list(members)
        options = {**group_options, **{k: v for k, v in group.items() if k != "params"}}
        split: dict[Any, list[torch.Tensor]] = {}
        for p in members:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"optim_param_groups: param group {i} holds a {type(p).__name__}, not a tensor")
            split.setdefault(_kind(p), []).append(p)
        out.extend({"params": ps, **options} for ps in split.values())
    return out
