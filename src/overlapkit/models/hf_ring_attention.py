"""Ring attention for every transformers model whose attention goes through transformers'
AttentionInterface: the K/V ring hides behind each layer's attention of the block in hand.

Registered once as the attention implementation `overlapkit_ring`; `apply_to_hf` sets it on a
model and gives each causal attention module its `RingAttention` over the CP group (the heads it
sees are whatever heads are local, so it composes with tensor parallelism over heads; grouped-query
attention is the ring's own). `parallelize` calls it when the mesh has a cp dim of size > 1.
Each rank feeds its tokens and their global positions (`shard_batch`), so RoPE rotates each token
by its place in the whole sequence; the zigzag cut balances the causal work. What the ring cannot
compute exactly is refused naming the config field: attention-logit soft-capping, attention
sinks, a sliding window shorter than the sequence, a padding mask, attention dropout.
"""

from __future__ import annotations

import torch
from torch import nn

from ..context_parallel.attention import ContextParallelConfig, RingAttention
from ..runtime.comm import group_size
from ..runtime.entry import guard_entry
from ..runtime.groups import resolve_group

HF_ATTENTION = "overlapkit_ring"
"""The attention implementation name registered with transformers' AttentionInterface."""

REFUSED_FIELDS = ("attn_logit_softcapping",)
"""Config fields that change the attention scores in a way the ring's blocks do not compute."""


def _hf_ring_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                       softcap=None, s_aux=None, **kwargs):
    # transformers passes q [b, h, s, d] and k, v [b, h_kv, s, d] (rotated by the positions given) and
    # wants [b, s, h, d] back. No mask was built for this implementation: the ring masks causally itself.
    ring = getattr(module, "cp_attention", None)
    name = type(module).__name__
    if ring is None:
        raise RuntimeError(f"{name} runs attn_implementation={HF_ATTENTION!r} but was not prepared by "
                           "overlapkit.models.hf_ring_attention.apply_to_hf (or parallelize on a mesh with a cp dim)")
    if dropout:
        raise ValueError(f"ring attention has no attention dropout; {name} asks for dropout={dropout} "
                         "(set the config's attention_dropout=0)")
    if attention_mask is not None:
        raise ValueError("ring attention is causal over whole sequences; a padding mask is not supported")
    if softcap is not None:
        raise ValueError(f"ring attention does not soft-cap attention logits; {name} asks for softcap={softcap} "
                         "(config.attn_logit_softcapping)")
    if s_aux is not None:
        raise ValueError(f"ring attention has no attention sinks; {name} passes s_aux (its learned sinks)")
    if sliding_window is not None:
        seq = query.shape[2] * group_size(ring.group)
        if seq > sliding_window:
            raise ValueError(f"ring attention is causal over the whole sequence; {name} has a sliding window of "
                             f"{sliding_window} tokens (config.sliding_window) shorter than the sequence of {seq}: "
                             "train on sequences no longer than the window, or without context parallelism")
    return ring(query.contiguous(), key.contiguous(), value.contiguous(), scale=scaling).transpose(1, 2), None


def is_causal_attention(module: nn.Module) -> bool:
    """A transformers attention module that dispatches through the AttentionInterface, causal."""
    return getattr(module, "is_causal", False) is True and hasattr(module, "layer_idx") and hasattr(module, "config")


def apply_to_hf(model: nn.Module, mesh_or_group, config: ContextParallelConfig = ContextParallelConfig()) -> nn.Module:
    """Swap ring attention into a transformers model in place; return it.

    Call the model with `input_ids, position_ids = shard_batch(ids, group)` and, for the labels=
    loss, `shift_labels=shard_labels(labels, group)` (each token's label is the next token of the
    whole sequence, which under the zigzag cut is not the next local one). ValueError naming the
    config field when the model's attention is something the ring does not compute.
    """
    from transformers import AttentionInterface

    group = resolve_group(mesh_or_group, "cp")
    cls = type(model).__name__
    cfgs = [m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")]
    for cfg in cfgs:
        for field in REFUSED_FIELDS:
            if getattr(cfg, field, None) is not None:
                raise ValueError(f"context parallelism: {cls} sets {type(cfg).__name__}.{field}="
                                 f"{getattr(cfg, field)!r}, which ring attention does not compute")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError(f"context parallelism: {cls} sets {type(cfg).__name__}.use_bidirectional_attention; "
                             "ring attention is causal")
    AttentionInterface.register(HF_ATTENTION, _hf_ring_attention)
    found = 0
    for name, module in model.named_modules():
        if is_causal_attention(module):
            module.cp_attention = RingAttention(group, config, causal=True, name=f"{name}.cp")
            found += 1
    if not found:
        raise ValueError(f"context parallelism: no causal attention module of transformers' kind found in {cls}")
    for cfg in cfgs:
        cfg._attn_implementation = HF_ATTENTION
    if group_size(group) > 1:
        model.register_forward_pre_hook(_require_global_positions, with_kwargs=True)
    # CP ranks hold different tokens of slices of one size: shapes compared every forward, not values.
    guard_entry(model, group, f"context parallel {cls}", same_values=False)
    return model


def _require_global_positions(module, args, kwargs):
    # Without them transformers numbers the local tokens 0..s_local-1: RoPE would be silently wrong.
    if kwargs.get("position_ids") is None:
        raise ValueError(f"{type(module).__name__} is context parallel: pass position_ids (the global positions of "
                         "this rank's tokens), e.g. input_ids, position_ids = shard_batch(ids, group)")
    mask = kwargs.get("attention_mask")
    # transformers builds no mask for this implementation: a padding mask would be dropped silently.
    if isinstance(mask, torch.Tensor) and not bool(mask.bool().all()):
        raise ValueError(f"{type(module).__name__} is context parallel: ring attention is causal over whole "
                         "sequences; an attention_mask with padding is not supported")
    if kwargs.get("labels") is not None and kwargs.get("shift_labels") is None:
        raise ValueError(f"{type(module).__name__} is context parallel: labels= would be shifted within this rank's "
                         "tokens, which are not consecutive; pass shift_labels=shard_labels(labels, group) too")


def dim_size(mesh, name: str) -> int:
    """The size of a dim of a DeviceMesh or ParallelGroups (1 when it has none)."""
    from torch.distributed.device_mesh import DeviceMesh

    from ..runtime.groups import ParallelGroups

    if isinstance(mesh, ParallelGroups):
        return getattr(mesh.sizes, name)
    if isinstance(mesh, DeviceMesh):
        names = tuple(mesh.mesh_dim_names or ())
        return mesh.size(names.index(name)) if name in names else 1
    return 1


def cp_dim(mesh):
    """The cp group of a mesh (DeviceMesh or ParallelGroups) whose cp dim has size > 1, else None."""
    if dim_size(mesh, "cp") == 1:
        return None
    return resolve_group(mesh, "cp")
