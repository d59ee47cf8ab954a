"""Swap tensor/sequence-parallel layers into a plain GPT after the fact.

Attention: qkv column-parallel -> proj row-parallel. MLP: fc1 column -> fc2 row. The output
head is column-parallel over the vocabulary with its output gathered. With sequence
parallelism the sequence is scattered over the TP ranks as it enters the blocks, and every
column layer all-gathers it / every row layer reduce-scatters back; the overlap mode of those
layers decides how much of that communication hides behind the GEMMs.

Parameters that live in the sequence-parallel region (layer norms, the row-parallel biases)
see only their rank's tokens: they are marked `param.sequence_parallel = True`, and their
gradients must be summed over the TP group after backward and before the optimizer step —
call `allreduce_sequence_parallel_grads(model, tp_group)` (the demo does).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ..groups import ParallelGroups
from ..tensor_parallel import mappings
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from .gpt import GPT


class ScatterToSequenceParallel(nn.Module):
    """Split the sequence (dim 0) over the TP ranks in forward; all-gather it in backward."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group

    def forward(self, x):
        return mappings.scatter_to_sp(x, self.group, "enter_blocks")


def _check_divides(cfg, tp: int, sequence_parallel: bool) -> None:
    needs = {"num_heads": cfg.num_heads, "ffn_hidden": cfg.ffn_hidden, "vocab_size": cfg.vocab_size}
    if sequence_parallel:
        needs["seq_len"] = cfg.seq_len
    for field, value in needs.items():
        if value % tp:
            raise ValueError(f"GPTConfig.{field}={value} is not divisible by the tensor-parallel size {tp}")


def parallelize(model: GPT, groups: ParallelGroups | dist.ProcessGroup, *, sequence_parallel: bool = True,
                overlap: str = "none", **layer_kwargs) -> GPT:
    """Replace the GPT's linear layers by TP layers in place and return the model.

    `groups` is a ParallelGroups (its .tp is used) or a TP process group. `overlap` and any
    extra keyword (e.g. transport=, chunks= of the pipelined layers) go to every parallel layer.
    """
    group = groups.tp if isinstance(groups, ParallelGroups) else groups
    tp = dist.get_world_size(group)
    _check_divides(model.cfg, tp, sequence_parallel)
    common = dict(sequence_parallel=sequence_parallel, overlap=overlap, **layer_kwargs)
    for i, block in enumerate(model.blocks):
        p = f"blocks.{i}"
        block.attn.qkv = ColumnParallelLinear.from_full(block.attn.qkv, group, name=f"{p}.attn.qkv", **common)
        block.attn.proj = RowParallelLinear.from_full(block.attn.proj, group, name=f"{p}.attn.proj", **common)
        block.mlp.fc1 = ColumnParallelLinear.from_full(block.mlp.fc1, group, name=f"{p}.mlp.fc1", **common)
        block.mlp.fc2 = RowParallelLinear.from_full(block.mlp.fc2, group, name=f"{p}.mlp.fc2", **common)
    model.head = ColumnParallelLinear.from_full(model.head, group, name="head", gather_output=True, **common)
    if sequence_parallel:
        model.enter_blocks = ScatterToSequenceParallel(group)
        for module in [model.ln_f] + [m for b in model.blocks for m in (b.ln1, b.ln2)]:
            for param in module.parameters():
                param.sequence_parallel = True
    return model


def expected_local(model: nn.Module, reference: nn.Module, what: str = "grad"):
    """Yield (name, local tensor, the reference's matching slice) for every parameter.

    `what` is "grad" or "data". Parallel layers hold a shard of the reference's parameter;
    everything else holds it whole. This is how the demo and the tests check a parallel model
    against a single-process one without any communication.
    """
    ref_params = dict(reference.named_parameters())
    owners = {}
    for mod_name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            for p_name, _ in module.named_parameters(recurse=False):
                owners[f"{mod_name}.{p_name}".removeprefix("module.")] = module
    for name, param in model.named_parameters():
        name = name.removeprefix("module.")
        ref = ref_params[name]
        local, full = (param.grad, ref.grad) if what == "grad" else (param.data, ref.data)
        owner = owners.get(name)
        yield name, local, (owner.shard_of(full) if owner is not None and full is not None else full)
