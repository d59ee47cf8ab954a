"""The user's model and its variants: a Hugging Face Llama config per preset, PyTorch's own TP+SP plan
for it (torchtitan's shape), and each variant user_step.py and compiled_step_profile.py train."""

from __future__ import annotations

import contextlib
import copy

import torch

PRESETS = {
    # the CPU config: a tiny HF Llama, 2 x 512 tokens
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=8, vocab_size=4096, batch=2, seq=512),
    # the 16-core host: a step of >= 200 ms at tp 4 and 8 (~0.5 TFLOP)
    "cpu16": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                  num_key_value_heads=8, vocab_size=32000, batch=2, seq=512),
    # ~1.1 B, the H200 config: 4 x 2048 tokens in bf16
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
               num_key_value_heads=8, vocab_size=32000, batch=4, seq=2048),
}
MODES = ("none", "bulk", "pipelined", "auto")


def torch_tp_plan(model) -> dict:
    """PyTorch's own TP+SP plan for HF Llama, in torchtitan's shape."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    plan = {
        # HF builds the causal mask and positions from the embedding's output: keep it whole, and
        # split the sequence where the first block takes it.
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "model.layers.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                             use_local_output=True),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}."
        plan.update({
            p + "input_layernorm": SequenceParallel(),
            p + "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            p + "self_attn.q_proj": ColwiseParallel(), p + "self_attn.k_proj": ColwiseParallel(),
            p + "self_attn.v_proj": ColwiseParallel(), p + "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            p + "post_attention_layernorm": SequenceParallel(),
            p + "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel(),
            p + "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        })
    return plan


def _check_default(model, tp: int) -> None:
    """parallelize's defaults are what the ok_auto row says: overlap="auto", with sequence parallelism at tp > 1
    (q/k/v compute locally on the input their attention gathered, so they have no mode of their own) and
    without it at tp 1 (one rank splits no sequence)."""
    from overlapkit.tensor_parallel import ColumnParallelLinear, GatheredInputColumnLinear, RowParallelLinear

    layers = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
              and not isinstance(m, GatheredInputColumnLinear)]
    wrong = sorted((m.name, m.overlap, m.sequence_parallel) for m in layers
                   if (m.overlap, m.sequence_parallel) != ("auto", tp > 1))
    if not layers or wrong:
        raise RuntimeError(f"ok_auto: parallelize's defaults are no longer auto with SP {'on' if tp > 1 else 'off'}: "
                           f"{wrong}")


def build_variant(name: str, base, groups, dp: int, compile_mode: str = "default"):
    """(model, context the step runs under) of variant `name`, from a copy of `base`.

    A `*_compiled` variant is the whole model under `torch.compile(fullgraph=True, mode=compile_mode)`:
    one graph or an error ("reduce-overhead": CUDA graphs of it)."""
    import overlapkit
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    model = copy.deepcopy(base)
    kind = name.removesuffix("_compiled")
    ctx = contextlib.nullcontext
    async_tp = kind == "torch_async_tp"
    if async_tp:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group
        enable_symm_mem_for_group(groups.mesh["tp"].get_group().group_name)
        kind = "torch_tp"
    if kind == "torch_tp":
        parallelize_module(model, groups.mesh["tp"], torch_tp_plan(model))
        if dp > 1:
            from torch.distributed.fsdp import fully_shard
            for block in model.model.layers:
                fully_shard(block, mesh=groups.mesh["dp"])
            fully_shard(model, mesh=groups.mesh["dp"])
        ctx = loss_parallel
        if async_tp:  # the config is read when the graph compiles, at the first step: only this variant's
            def ctx():
                stack = contextlib.ExitStack()
                stack.enter_context(loss_parallel())
                stack.enter_context(torch._inductor.config.patch(_micro_pipeline_tp=True))
                return stack
    elif kind.startswith("ok_"):
        mode, sp = kind[3:].removesuffix("_nosp"), not kind.endswith("_nosp")
        # ok_auto is the default row: built passing nothing, so it measures what a user gets
        # (checked to be auto, with SP on at tp > 1: the row's name).
        opts = {} if (mode, sp) == ("auto", True) else dict(overlap=mode, sequence_parallel=sp)
        overlapkit.parallelize(model, groups.mesh, **opts)
        if not opts:
            _check_default(model, groups.sizes.tp)
        if dp > 1:
            from overlapkit.data_parallel import DataParallel
            model = DataParallel(model, groups.dp)
    if name.endswith("_compiled"):
        if kind == "torch_tp":
            model = _LossOnly(model)
        model = torch.compile(model, fullgraph=True, mode=compile_mode)
    return model, ctx


class _LossOnly(torch.nn.Module):
    """PyTorch TP's model returning its loss alone: compiled, its DTensor logits (`loss_parallel`'s input),
    which no gradient reaches, fail the graph's backward (PyTorch #172556); overlapkit's head returns
    plain logits when compiled. The step reads only `.loss`."""

    def __init__(self, model) -> None:
        super().__init__()
        self.inner = model

    def forward(self, **kwargs):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(loss=self.inner(**kwargs).loss)
