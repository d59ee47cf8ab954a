"""Sequence parallelism through a transformers MoE block: each TP rank routes the tokens of its slice of the sequence, and the load-balancing loss still sees every token.

Under sequence parallelism a decoder layer's MLP input is this rank's slice of the sequence, so the
router, top-k, normalisation and the experts act on this rank's tokens only (they act per token:
the same numbers as on the whole sequence). Two things are not per token, and this style takes care
of both:

- the model's load-balancing loss (Switch's: the fraction routed to each expert times its mean
  probability, means over *all* tokens) reads the router logits the model records. The router's
  recorded output (its first, the logits: [tokens, experts]) is all-gathered over TP into the
  order one process has ([batch, sequence] flattened), and split again in backward (every TP rank
  computes the same loss from the same logits, so its gradient is whole on every rank). The block
  discards that output itself (it routes by the top-k weights and indices), which every family
  this is tested on does; a block that reads it gets more rows than it routes and fails on shapes.
- the parameters' gradients cover this rank's tokens only: the router's (and an unsplit experts
  module's) are summed over TP inside autograd (`mark_sequence_parallel`); experts split over ep
  (hf_experts.py) sum their local shards over TP the same way in their routed forward, and experts
  another engine split (DTensors on its own mesh) by a hook on each gradient.
"""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from ..runtime import comm
from ..runtime.groups import resolve_group
from ..tensor_parallel.mappings import gather_from_tp
from ..tensor_parallel.region import split_here
from ..tensor_parallel.sequence_parallel import mark_sequence_parallel
from .hf_experts import sum_expert_grads_over

ROUTER_OUTPUT = "router_logits"
"""The output name under which a transformers model records its routers' logits (`_can_record_outputs`)."""


def router_classes(model: nn.Module) -> tuple[type, ...]:
    """The module classes whose first output the model records as its router logits (empty when none)."""
    spec = (getattr(type(model), "_can_record_outputs", None) or {}).get(ROUTER_OUTPUT)
    if spec is None:
        return ()
    target = spec if isinstance(spec, type) else getattr(spec, "target_class", None)
    if target is None or getattr(spec, "index", 0) != 0 or getattr(spec, "layer_name", None):
        return ()  # recorded by name or another output: not a shape this style knows
    return (target,)


class MoEBlockSequenceParallel(ParallelStyle):
    """A MoE block (its `router` and `experts` children named) on this rank's slice of the sequence.

    Its input must be [batch, sequence slice, hidden] (its sequence slice orders the gathered logits).
    """

    def __init__(self, *, router: str, experts: str) -> None:
        self.router, self.experts = router, experts

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        group = resolve_group(device_mesh, "tp")
        name = getattr(module, "_overlapkit_name", "") or type(module).__name__
        router, experts = module.get_submodule(self.router), module.get_submodule(self.experts)
        seq: list[int] = []
        module.register_forward_pre_hook(functools.partial(_note_sequence, seq, name), with_kwargs=True)
        mark_sequence_parallel(router, device_mesh, name=f"{name}.{self.router}")
        router.forward = _GatheredLogits(router, router.forward, group, seq, f"{name}.{self.router}")
        label = f"{name}.{self.experts}"
        if sum_expert_grads_over(experts, group, label):
            pass  # split over ep by parallelize: its routed forward sums the local shards over tp
        elif any(hasattr(p, "device_mesh") for p in experts.parameters()):
            # split over ep by another engine (DTensors on its own mesh): each gradient summed over tp
            for pname, p in experts.named_parameters():
                if p.requires_grad:
                    p.register_hook(functools.partial(_sum_over_tp, group, f"{label}.{pname}"))
        else:
            mark_sequence_parallel(experts, device_mesh, name=label)
        return module

    def __repr__(self) -> str:
        return f"MoEBlockSequenceParallel(router={self.router!r}, experts={self.experts!r})"


def _sum_over_tp(group, name: str, grad: torch.Tensor) -> torch.Tensor:
    # The gradient of this rank's tokens (a DTensor's local shard, or a plain tensor), summed over tp.
    local = (grad._local_tensor if hasattr(grad, "_local_tensor") else grad).clone()
    comm.all_reduce(local, group, kind="tp_all_reduce", name=name, async_op=False)
    if not hasattr(grad, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, grad.device_mesh, grad.placements, run_check=False, shape=grad.shape,
                              stride=grad.stride())


def _note_sequence(seq: list, name: str, _module, args, kwargs):
    x = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(f"{name} under sequence parallelism takes hidden_states [batch, sequence, hidden], got "
                         f"{getattr(x, 'shape', type(x).__name__)}")
    # The local sequence length, not the batch: inference runs the block's own forward on parts of the
    # batch (expert_parallel.two_batch) without this hook, and every part keeps the sequence whole.
    seq[:] = [x.shape[1]]
    # The region keeps activations sequence-major (tensor_parallel/layout.py); the block flattens its
    # input with .view into [tokens, hidden], which needs the batch-major layout of a plain model.
    x = x.contiguous()
    return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})


class _GatheredLogits:
    """The router's forward with its first output (the logits the model records) gathered over TP."""

    def __init__(self, router: nn.Module, forward, group, seq: list, name: str) -> None:
        self.router, self.forward, self.group, self.seq, self.name = router, forward, group, seq, name

    def __call__(self, *args, **kwargs):
        out = self.forward(*args, **kwargs)
        if not split_here(self.router):
            return out  # the sequence passes whole this forward (a decode step): nothing to gather
        if not isinstance(out, tuple) or not isinstance(out[0], torch.Tensor) or out[0].dim() != 2:
            raise TypeError(f"{self.name} ({type(self.router).__name__}) under sequence parallelism must return "
                            "(logits [tokens, experts], ...), so that its logits can be gathered for the "
                            "load-balancing loss")
        logits = out[0]
        b = logits.shape[0] // self.seq[0]
        # [b * s_local, E] -> [b, s_local * E]: concatenating the ranks' last dims is [b, s, E] in order
        whole = gather_from_tp(logits.reshape(b, -1), self.group, f"{self.name}.router_logits")
        return (whole.reshape(-1, logits.shape[-1]), *out[1:])

    def __deepcopy__(self, memo):  # a deep copy of the model gets a forward bound to its own router
        router = memo.get(id(self.router), self.router)
        return _GatheredLogits(router, type(router).forward.__get__(router), self.group,
                               copy.deepcopy(self.seq, memo), self.name)
