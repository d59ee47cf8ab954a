"""Built-in tensor/sequence-parallel plans: our tiny GPT and HuggingFace `LlamaForCausalLM`.

A plan is what torchtitan's `parallelize.py` writes: module path (fnmatch, `*` for every
layer) -> ParallelStyle, applied by `parallelize_module` on the mesh's "tp" dim. Each plan
function also checks, before anything is sliced, that the model's sizes split over `tp`,
naming the config field that does not. docs/plans.md shows how to write one for another model.

Both plans split the embedding and the output head over the vocabulary: the logits are a
DTensor holding this rank's columns [tokens, V/tp] (sharded on the last dim), and the loss is
`vocab_parallel_cross_entropy` (never an all-gather of [tokens, V]): GPT's `lm_loss` and HF's
`labels=` loss use it, and torch's own cross_entropy refuses the DTensor instead of computing
a wrong number from a slice. Under sequence parallelism the sequence is split as it
enters the first block and stays split through the norms and residual adds; every column
layer all-gathers it and every row layer reduce-scatters it back, as `overlap` says.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..tensor_parallel.styles import (ColwiseParallel, GatherSequence, RowwiseParallel, ScatterSequence,
                                      SequenceParallel, VocabParallel)
from ..tensor_parallel.vocab import vocab_parallel_cross_entropy


def _check_divides(prefix: str, tp: int, **sizes: int) -> None:
    for field, value in sizes.items():
        if value % tp:
            raise ValueError(f"{prefix}.{field}={value} is not divisible by the tensor-parallel size {tp}")


def gpt_plan(model: nn.Module, tp: int, *, overlap: str, sequence_parallel: bool, **layer_kwargs) -> dict:
    """The plan of overlapkit.models.GPT (activations [s, b, h]: the sequence is dim 0)."""
    cfg = model.cfg
    sizes = dict(num_heads=cfg.num_heads, ffn_hidden=cfg.ffn_hidden, vocab_size=cfg.vocab_size)
    if sequence_parallel:
        sizes["seq_len"] = cfg.seq_len
    _check_divides("GPTConfig", tp, **sizes)
    lin = dict(overlap=overlap, sequence_parallel=sequence_parallel, **layer_kwargs)
    plan = {
        "tok_emb": VocabParallel(),
        "blocks.*.attn.qkv": ColwiseParallel(**lin),
        "blocks.*.attn.proj": RowwiseParallel(**lin),
        "blocks.*.mlp.fc1": ColwiseParallel(**lin),
        "blocks.*.mlp.fc2": RowwiseParallel(**lin),
        "head": ColwiseParallel(**lin, use_local_output=False),
    }
    if sequence_parallel:
        plan["enter_blocks"] = ScatterSequence(sequence_dim=0)
        for norm in ("blocks.*.ln1", "blocks.*.ln2", "ln_f"):
            plan[norm] = SequenceParallel()
    return plan


def is_hf_llama(model: nn.Module) -> bool:
    """A transformers LlamaForCausalLM (checked by class, without importing transformers)."""
    return any(c.__name__ == "LlamaForCausalLM" and c.__module__.startswith("transformers.")
               for c in type(model).__mro__)


def llama_plan(model: nn.Module, tp: int, *, overlap: str, sequence_parallel: bool, **layer_kwargs) -> dict:
    """The plan of transformers' LlamaForCausalLM (activations [b, s, h]: the sequence is dim 1).

    HF attention reads the sequence length from its input, so under SP the attention input is
    all-gathered once at the module (`GatherSequence`) and q/k/v compute on it locally; its
    backward reduce-scatters the sum of their input gradients. The MLP's gate/up projections
    gather their input themselves, hidden behind their GEMMs as `overlap` says, and o_proj /
    down_proj reduce-scatter behind theirs.
    """
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if cfg.num_attention_heads * head_dim != cfg.hidden_size and not getattr(cfg, "head_dim", None):
        raise ValueError(f"LlamaConfig.hidden_size={cfg.hidden_size} is not heads x head_dim")
    _check_divides("LlamaConfig", tp, num_attention_heads=cfg.num_attention_heads,
                   num_key_value_heads=cfg.num_key_value_heads, intermediate_size=cfg.intermediate_size,
                   vocab_size=cfg.vocab_size)
    seq = dict(sequence_parallel=sequence_parallel, sequence_dim=1) if sequence_parallel else {}
    lin = dict(overlap=overlap, **seq, **layer_kwargs)
    # q/k/v: with SP they read the input GatherSequence made whole; without SP each sums its
    # input gradient itself (an all-reduce, hidden behind its wgrad under bulk).
    qkv = ColwiseParallel(input_gathered=True) if sequence_parallel else ColwiseParallel(**lin)
    plan = {
        "model.embed_tokens": VocabParallel(),
        "model.layers.*.self_attn.q_proj": qkv,
        "model.layers.*.self_attn.k_proj": qkv,
        "model.layers.*.self_attn.v_proj": qkv,
        "model.layers.*.self_attn.o_proj": RowwiseParallel(**lin),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(**lin),
        "model.layers.*.mlp.up_proj": ColwiseParallel(**lin),
        "model.layers.*.mlp.down_proj": RowwiseParallel(**lin),
        "lm_head": ColwiseParallel(**lin, use_local_output=False),
    }
    if sequence_parallel:
        plan["model.layers.0"] = ScatterSequence(sequence_dim=1)
        plan["model.layers.*.self_attn"] = GatherSequence(sequence_dim=1)
        for norm in ("model.layers.*.input_layernorm", "model.layers.*.post_attention_layernorm", "model.norm"):
            plan[norm] = SequenceParallel()
    return plan


def causal_lm_loss(logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100,
                   shift_labels=None, *, group, **_):
    """HF's ForCausalLMLoss (shift by one, mean over non-ignored tokens) on vocabulary-split logits."""
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.to(logits.device)
    if num_items_in_batch is None:
        return vocab_parallel_cross_entropy(logits, shift_labels, group, ignore_index=ignore_index)
    total = vocab_parallel_cross_entropy(logits, shift_labels, group, ignore_index=ignore_index, reduction="sum")
    return total / num_items_in_batch


def is_hf(model: nn.Module) -> bool:
    """A transformers PreTrainedModel (checked by class, without importing transformers)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
               for c in type(model).__mro__)


def example_inputs(model: nn.Module, tp: int) -> dict | None:
    """Keyword inputs of a few tokens a model's forward takes (an HF causal LM's input_ids), or None."""
    if not is_hf(model):
        return None
    param = next(model.parameters(), None)
    device = param.device if param is not None else None
    example = {"input_ids": torch.zeros(1, 2 * tp, dtype=torch.long, device=device)}
    from .hf_ring_attention import HF_ATTENTION
    if getattr(getattr(model, "config", None), "_attn_implementation", None) == HF_ATTENTION:
        # ring attention already swapped in (a cp dim): its forward takes the tokens' global positions
        example["position_ids"] = torch.arange(2 * tp, device=device).unsqueeze(0)
    return example


def after_hf(model: nn.Module, group) -> None:
    """What an HF model needs beyond the styles: with an output head split over the vocabulary,
    HF's `labels=` loss on split logits; a `save_pretrained` that writes whole tensors."""
    from ..tensor_parallel.layers import ColumnParallelLinear
    from .hf_checkpoint import wrap_save_pretrained

    wrap_save_pretrained(model)

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, ColumnParallelLinear) and not head.gather_output and hasattr(model, "loss_function"):
        # HF computes `labels=` losses with model.loss_function, over the full vocabulary: on the
        # split logits it would be wrong, so it becomes the vocabulary-parallel one.
        model.loss_function = functools.partial(causal_lm_loss, group=group)



HEAD_COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads")
"""The attribute names attention modules keep their head counts under (HF's and torchtitan's)."""


def set_local_heads(model: nn.Module, tp: int) -> list[str]:
    """Divide by `tp` the head counts of every module whose column layers give this rank its heads.

    An attention whose forward reshapes by `self.num_heads` (HF StableLM, GPT-2-style code)
    would otherwise view this rank's heads as all of them. A module counts when a direct child
    is a column layer that does not gather its output and another is a row layer (q/k/v and o);
    a count that does not split is a ValueError naming it. Returns "path.attr" of what was set.
    """
    from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    done = []
    for path, module in model.named_modules():
        children = list(module.children())
        if not (any(isinstance(c, ColumnParallelLinear) and not c.gather_output for c in children)
                and any(isinstance(c, RowParallelLinear) for c in children)):
            continue
        for attr in HEAD_COUNTS:
            value = module.__dict__.get(attr)
            if type(value) is not int:
                continue
            if value % tp:
                raise ValueError(f"parallelize: {path}.{attr}={value} is not divisible by the tensor-parallel size {tp}")
            setattr(module, attr, value // tp)
            done.append(f"{path}.{attr}")
    return done
