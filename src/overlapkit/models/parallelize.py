"""`parallelize(model, mesh)`: tensor/sequence parallelism after the fact, by a plan of ParallelStyles.

The plan (module path -> style, see overlapkit.tensor_parallel.styles) is applied by torch's
`parallelize_module` on the mesh's "tp" dim; the styles install overlapkit's layers, whose
overlap mode decides how much of the all-gathers / reduce-scatters hides behind the GEMMs.
With `plan=None` the plan is picked by model type (plans.py: our GPT, HF LlamaForCausalLM), or
translated from a transformers model's own `tp_plan` (hf_plans.py). Parameters shared by
several modules (tied weights) stay one parameter, or the plan is refused naming them.

Before anything is sliced every rank checks the same things and fails alike, naming values:
the mesh has a "tp" dim, every plan key names a module, the model's sizes split over tp,
and every rank of the TP group was given the same plan and options (store-based agreement,
so a rank with another plan fails instead of hanging in a collective).

At a TP size above 1 every parameter comes out a DTensor on the TP mesh: the TP layers' sharded,
every other one (norms, biases outside the TP layers) `Replicate()` (tensor_parallel/replicated.py),
so `clip_grad_norm_`, foreach/fused optimizers and EMA loops work on `model.parameters()` as they
are. At TP size 1 every parameter is a plain tensor, as in the model before (the TP layers' state
dict still gives DTensors on the 1-rank mesh), unless experts are split over ep: they are DTensors
on the ep mesh, so every other parameter stays a DTensor too (one kind for foreach optimizers). Parameters in the sequence-parallel region (norms) see only their rank's tokens; their
gradients are summed over TP inside autograd, complete when backward returns.
"""

from __future__ import annotations

from fnmatch import fnmatch

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from ..inference import InferenceConfig
from ..runtime.agreement import agree
from ..runtime.entry import guard_entry
from ..runtime.groups import ParallelGroups, resolve_group
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..tensor_parallel.params import LocalShardParams, is_dtensor, tp_mesh
from ..tensor_parallel.region import attach_region
from ..tensor_parallel.styles import ScatterSequence
from ..tensor_parallel.replicated import replicate_parameters
from ..tensor_parallel.vocab import VocabParallelEmbedding
from . import plans
from .gpt import GPT
from .hf_decode import prepare_decode
from .hf_experts import shard_experts
from .hf_plans import translate_hf_plan
from .plan_edges import watch_edges
from .tied import check_tied_plan, find_tied, retie


def builtin_plan(model: nn.Module, tp: int, *, overlap: str, sequence_parallel: bool | None,
                 **layer_kwargs) -> dict:
    """The plan for this model: built in (our GPT, HF Llama), else translated from a transformers
    model's own `tp_plan` (hf_plans.py); ValueError naming the type when there is neither.

    `sequence_parallel=None`: on for the built-in plans, on where the model allows it for a
    translated one; off for a transformers model at tp 1 (unless overlap is "pipelined").
    """
    if tp == 1 and sequence_parallel is None and plans.is_hf(model) and overlap != "pipelined":
        # One rank splits no sequence: the sequence-parallel entries would only be hooks on every attention
        # and the first layer, paid per forward (a decode step's host time), with nothing to gain
        # ("pipelined", which chunks the sequence-parallel collectives, keeps them as asked).
        sequence_parallel = False
    if isinstance(model, GPT):
        return plans.gpt_plan(model, tp, overlap=overlap, sequence_parallel=sequence_parallel is not False,
                              **layer_kwargs)
    if plans.is_hf_llama(model):
        return plans.llama_plan(model, tp, overlap=overlap, sequence_parallel=sequence_parallel is not False,
                                **layer_kwargs)
    if not plans.is_hf(model):
        raise ValueError(f"parallelize: no built-in plan for {type(model).__module__}.{type(model).__name__} (built "
                         "in: overlapkit.models.GPT, transformers models with a tp_plan); pass plan={module path: "
                         "ParallelStyle} (docs/plans.md)")
    return translate_hf_plan(model, tp, overlap=overlap, sequence_parallel=sequence_parallel, **layer_kwargs)


def check_plan(model: nn.Module, plan: dict) -> None:
    """Every key names at least one module (as parallelize_module matches it) and maps to a ParallelStyle."""
    paths = [name for name, _ in model.named_modules() if name]
    for key, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise TypeError(f"parallelize: plan[{key!r}] is a {type(style).__name__}, not a ParallelStyle")
        tokens = key.split(".")
        if not any(len(p.split(".")) == len(tokens) and all(fnmatch(a, b) for a, b in zip(p.split("."), tokens))
                   for p in paths):
            top = sorted({p.split(".")[0] for p in paths})
            raise ValueError(f"parallelize: plan key {key!r} names no module of {type(model).__name__} (its top-level "
                             f"modules: {top})")


def parallelize(model: nn.Module, mesh, *, overlap: str | None = None, sequence_parallel: bool | None = None,
                plan: dict | None = None, inference: InferenceConfig | None = None, **layer_kwargs) -> nn.Module:
    """Make `model` tensor (and sequence) parallel over the mesh's "tp" dim, in place; return it.

    `mesh`: a DeviceMesh with a "tp" dim (or a 1-D one), a ParallelGroups, or a TP ProcessGroup.
    `plan=None` picks the built-in plan by model type, or translates a transformers model's own
    `tp_plan`, built with `overlap` (default "auto": the cost model picks each GEMM's mode, the
    setting the README's numbers measure) and `sequence_parallel` (default: on for the built-in
    plans, on where the model allows it for a translated one; off for a transformers model at tp 1 unless overlap is "pipelined"); any extra keyword (transport=,
    chunks=, hardware=) goes to every parallel linear layer. A plan you pass carries its options in its styles,
    so `overlap`, `sequence_parallel` and layer keywords are refused with it. `inference`: how a transformers
    model's `generate()` runs its prompts and decode steps (InferenceConfig; docs/inference.md).
    On a mesh with a "cp" dim of size > 1 a transformers model also gets ring attention over it
    (hf_ring_attention.apply_to_hf), before the TP plan.
    Collective over the TP group (one store round trip to compare the plan across ranks).
    """
    if context_parallel(model, mesh):
        return model
    mesh_1d = tp_mesh(mesh)
    group = resolve_group(mesh_1d, "tp")
    tp = mesh_1d.size()
    if plan is None:
        overlap = "auto" if overlap is None else overlap
        plan = builtin_plan(model, tp, overlap=overlap, sequence_parallel=sequence_parallel, **layer_kwargs)
    elif overlap is not None or sequence_parallel is not None or layer_kwargs:
        given = dict(overlap=overlap, sequence_parallel=sequence_parallel, **layer_kwargs)
        raise ValueError(f"parallelize: with plan= the styles carry their own options; got also "
                         f"{ {k: v for k, v in given.items() if v is not None} }")
    if not isinstance(plan, dict):
        raise TypeError(f"parallelize: plan must be a dict of module path -> ParallelStyle, got {type(plan).__name__}")
    check_plan(model, plan)
    tied = find_tied(model)
    agree(group, "parallelize", model=type(model).__name__, tp=tp,
          plan=sorted((k, repr(v)) for k, v in plan.items()), tied=tied, inference=repr(inference or InferenceConfig()))
    check_tied_plan(plan, tied)
    shard_experts(model, mesh)  # experts over the ep ranks init carved out of dp, from the model's ep_plan
    for name, module in model.named_modules():
        module._overlapkit_name = name  # styles name their layers (timeline spans) by path
    try:
        parallelize_module(model, mesh_1d, plan)
    finally:
        for module in model.modules():
            module.__dict__.pop("_overlapkit_name", None)
    retie(model, tied)
    plans.set_local_heads(model, tp)  # attention that reshapes by its head count sees this rank's heads
    if tp == 1 and not any(getattr(p, "expert_parallel", False) and is_dtensor(p) for p in model.parameters()):
        # One rank: nothing is split or summed, and a DTensor parameter would only cost host time
        # (a compiled graph unwraps and re-wraps each one at its edges every step, and every
        # optimizer and clipping op dispatches through DTensor): plain parameters, the plain model's.
        # Not with experts split over ep (DTensors on the ep mesh, hf_experts.py): foreach/fused
        # optimizers refuse a list mixing them with plain tensors, so there every parameter stays one.
        done: dict = {}
        for module in model.modules():
            if isinstance(module, LocalShardParams):
                module.localize_parameters(done)
    else:
        # Every other parameter a DTensor Replicate() on the same mesh, so whole-model loops
        # (clip_grad_norm_, foreach optimizers) see one kind; the modules compute on local views.
        replicate_parameters(model, mesh_1d, group)
    if plans.is_hf(model):
        plans.after_hf(model, group)
    attach_region(model)  # sequence parallelism steps aside where a forward's sequence does not split
    if plans.is_hf(model):  # generate(): decode steps in the inference layout, prompts split as in training
        prepare_decode(model, tp, sequence_parallel=any(isinstance(s, ScatterSequence) for s in plan.values()),
                       config=inference)
    if tp > 1 and not isinstance(model, GPT):  # the GPT's plan leaves no parameter between its layers
        # parameters between column and row layers (plan_edges.py): decided here for an HF model
        # (a forward of a few tokens), at the first forward for a module whose inputs are unknown
        watch_edges(model, group, example=plans.example_inputs(model, tp))
    if tp > 1:  # every TP rank must be fed the same batch: compared before the first collective, every forward
        guard_entry(model, group, f"parallelize({type(model).__name__})")
    return model


def context_parallel(model: nn.Module, mesh) -> bool:
    """A mesh with a cp dim of size > 1: ring attention in a transformers model's attention (hf_ring_attention).
    True when the mesh has no tp dim of size > 1, so that there is nothing more to apply."""
    from .hf_ring_attention import apply_to_hf, cp_dim, dim_size

    cp = cp_dim(mesh)
    if cp is None or not plans.is_hf(model):  # our GPT takes its ring by models.ring_attention.apply_to_gpt
        return False
    apply_to_hf(model, cp)
    return dim_size(mesh, "tp") == 1


def _local(t):
    return t.to_local() if t is not None and hasattr(t, "to_local") else t


def expected_local(model: nn.Module, reference: nn.Module, what: str = "grad"):
    """Yield (name, local tensor, the reference's matching slice) for every parameter.

    `what` is "grad" or "data". Parallel layers hold a shard of the reference's parameter;
    everything else holds it whole. This is how the demo and the tests check a parallel model
    against a single-process one without any communication.
    """
    ref_params = dict(reference.named_parameters())
    owners = {}
    for mod_name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
            for p_name, _ in module.named_parameters(recurse=False):
                owners[f"{mod_name}.{p_name}".removeprefix("module.")] = module
    for name, param in model.named_parameters():
        name = name.removeprefix("module.")
        ref = ref_params[name]
        local, full = (param.grad, ref.grad) if what == "grad" else (param.data, ref.data)
        owner = owners.get(name)
        yield name, _local(local), (owner.shard_of(full) if owner is not None and full is not None else full)
