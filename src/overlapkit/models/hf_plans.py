"""A plan of overlapkit's styles from a transformers model's own tensor-parallel plan (`model.tp_plan`).

Nothing here overlaps anything: it decides which style each module gets (colwise ->
ColwiseParallel, rowwise -> RowwiseParallel, embedding_rowwise -> VocabParallel, ...), and refuses
with the module and style named what it cannot translate. docs/plans.md has the whole table and
how sequence parallelism enters and leaves the decoder layers.
"""

from __future__ import annotations

import re
from fnmatch import fnmatch

import torch
from torch import nn

from ..tensor_parallel.styles import (ColwiseParallel, GatherSequence, RowwiseParallel, ScatterSequence,
                                      SequenceParallel, VocabParallel)
from .hf_experts import expert_modules
from .hf_moe_sp import MoEBlockSequenceParallel, router_classes

COLWISE = ("colwise", "local_colwise")
COLWISE_GATHERED = ("colwise_rep", "colwise_gather_output")
ROWWISE = ("rowwise", "local_rowwise")
ROWWISE_REPLICATED_INPUT = ("rowwise_rep", "rowwise_split_input")
EMBEDDING = ("embedding_rowwise",)
GRAD_SUM = ("replicated_with_grad_allreduce",)
SEQUENCE = ("sequence_parallel",)
REPLICATED = ("replicate", "local")
TRANSLATED = (*COLWISE, *COLWISE_GATHERED, *ROWWISE, *ROWWISE_REPLICATED_INPUT, *EMBEDDING, *GRAD_SUM, *SEQUENCE,
              *REPLICATED)
"""The transformers style names this translation expresses."""

_MLP_NAMES = ("mlp", "feed_forward", "ffn")
"""Module names of blocks that only chain linears: their column layers may gather their own input."""


def hf_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's own tensor-parallel plan, module path -> transformers style name ({} when it has none)."""
    plan = getattr(model, "tp_plan", None)
    if plan is None:  # transformers releases before `tp_plan`: the config's plan under the base model
        config = getattr(model, "config", None)
        base = getattr(config, "base_model_tp_plan", None) or {}
        prefix = getattr(model, "base_model_prefix", "")
        prefix = f"{prefix}." if prefix and hasattr(model, prefix) else ""
        plan = {**{prefix + k: v for k, v in base.items()}, **(getattr(type(model), "_tp_plan", None) or {})}
    return dict(plan or {})


def _matches(pattern: str, path: str) -> bool:
    tokens, parts = pattern.split("."), path.split(".")
    return len(tokens) == len(parts) and all(fnmatch(p, t) for p, t in zip(parts, tokens))


def _divides(model: nn.Module, tp: int, **sizes) -> None:
    cls = type(getattr(model, "config", model)).__name__
    for field, value in sizes.items():
        if value is not None and value % tp:
            raise ValueError(f"{cls}.{field}={value} is not divisible by the tensor-parallel size {tp}")


def _module_styles(model: nn.Module, hf_plan: dict[str, str]) -> dict[str, str]:
    """Module path -> HF style name, every plan entry resolved; refusals name the module and the style."""
    paths = dict(model.named_modules())
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    cls = type(model).__name__
    # the experts modules and their parameters, by path
    experts = [p for e, m in expert_modules(model).items() for p in (e, *(f"{e}.{n}" for n, _ in m.named_parameters()))]
    out: dict[str, str] = {}
    for pattern, style in hf_plan.items():
        if any(_matches(pattern, p) for p in experts):
            # Some releases' tp_plan shards each expert's GEMMs over TP (transformers 5.17: moe_tp_experts,
            # packed_colwise on experts.gate_up_proj): overlapkit places experts by the ep_plan instead
            # (whole experts over the ep ranks, each replicated over tp), as the later releases' plans do.
            continue
        hits = [p for p in paths if p and _matches(pattern, p)]
        if not hits:
            if any(_matches(pattern, p) for p in params):
                raise ValueError(f"parallelize: {cls}'s tp_plan shards the parameter {pattern!r} directly "
                                 f"({style!r}); overlapkit's styles work on modules: pass plan= (docs/plans.md)")
            continue  # e.g. a head the config names but this model class lacks
        if style not in TRANSLATED:
            raise ValueError(f"parallelize: {cls}'s tp_plan gives {hits[0]!r} the style {style!r}, which overlapkit "
                             f"cannot express (it translates {sorted(TRANSLATED)}); pass plan= (docs/plans.md)")
        for path in hits:
            out[path] = style
    return out


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _own_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def _is_per_token(module: nn.Module) -> bool:
    """Whether a module with parameters is known to act on each token alone (safe on a slice of the sequence)."""
    return isinstance(module, (nn.LayerNorm, nn.Linear, getattr(nn, "RMSNorm", nn.LayerNorm))) or \
        "norm" in type(module).__name__.lower()


class _SPRefused(ValueError):
    """Why this model cannot run sequence parallel under the translated plan."""


def translate_hf_plan(model: nn.Module, tp: int, *, overlap: str, sequence_parallel: bool | None,
                      **layer_kwargs) -> dict:
    """overlapkit's plan for a transformers causal LM from its own `tp_plan`.

    `sequence_parallel=None` turns it on where the model's structure allows it (and off, with
    the reason in a ValueError only when it was asked for with True). ValueError naming the
    module for anything the translation cannot express, and naming the config field for sizes
    that do not split over `tp`.
    """
    hf_plan = hf_tp_plan(model)
    if not hf_plan:
        raise ValueError(f"parallelize: {type(model).__name__} has no tensor-parallel plan in its config "
                         "(base_model_tp_plan) and overlapkit has no built-in one; pass plan={module path: "
                         "ParallelStyle} (docs/plans.md)")
    styles = _module_styles(model, hf_plan)
    modules = dict(model.named_modules())
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {id(m): n for n, m in modules.items()}
    emb_path = names.get(id(emb)) if isinstance(emb, nn.Embedding) else None
    head_path = names.get(id(head)) if isinstance(head, nn.Linear) else None
    for path, style in styles.items():
        if style in EMBEDDING and path != emb_path:
            raise ValueError(f"parallelize: {path!r} has the style {style!r} but is not the input embedding "
                             f"({emb_path!r}): only that one is split over the vocabulary")
    linears = {p: s for p, s in styles.items() if s in (*COLWISE, *COLWISE_GATHERED, *ROWWISE,
                                                         *ROWWISE_REPLICATED_INPUT) and p != head_path}
    for path in linears:
        if type(modules[path]) is not nn.Linear:
            raise ValueError(f"parallelize: {path!r} ({type(modules[path]).__name__}) has the style "
                             f"{styles[path]!r}; overlapkit's column/row styles apply to an nn.Linear")
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    local_heads = any(s in COLWISE for p, s in linears.items() if not _is_mlp(p))
    _divides(model, tp, vocab_size=getattr(text, "vocab_size", None),
             **({"num_attention_heads": getattr(text, "num_attention_heads", None),
                 "num_key_value_heads": getattr(text, "num_key_value_heads", None)} if local_heads else {}))
    for path, style in linears.items():
        lin = modules[path]
        size, field = (lin.in_features, "in_features") if style in (*ROWWISE, *ROWWISE_REPLICATED_INPUT) \
            else (lin.out_features, "out_features")
        if size % tp:
            raise ValueError(f"parallelize: {path}.{field}={size} is not divisible by the tensor-parallel size {tp}")

    blocks = {_parent(p) for p in linears}
    layers = _layers_list(modules, blocks, type(model).__name__)
    sp = sequence_parallel
    try:
        checks = _sp_plan(model, modules, styles, blocks, layers, emb_path, head_path)
    except _SPRefused as why:
        if sp:
            raise ValueError(f"parallelize: sequence_parallel=True: {why}; pass sequence_parallel=False") from None
        checks, sp = None, False
    sp = checks is not None if sp is None else sp

    seq = dict(sequence_parallel=True, sequence_dim=1) if sp else {}
    lin_opts = dict(overlap=overlap, **seq, **layer_kwargs)
    plan: dict = {}
    if emb_path is not None:
        plan[emb_path] = _vocab_style(modules[emb_path], emb_path)
    moe_blocks = [p for p, s in (checks or {}).items() if isinstance(s, MoEBlockSequenceParallel)] if sp else []
    for block in sorted(blocks):
        # A shared expert inside a MoE block takes the block's flattened [tokens, hidden]: its
        # sequence slice is dim 0, and it acts per token, so it gathers and scatters there itself.
        in_moe = any(block.startswith(m + ".") for m in moe_blocks)
        gathers = sp and not _is_mlp(block) and not in_moe
        if gathers:
            plan[block] = GatherSequence(sequence_dim=1)
        opts_here = {**lin_opts, "sequence_dim": 0} if in_moe else lin_opts
        for path in sorted(p for p in linears if _parent(p) == block):
            style = linears[path]
            if style in (*COLWISE, *COLWISE_GATHERED):
                gather = dict(gather_output=True) if style in COLWISE_GATHERED else {}
                opts = dict(input_gathered=True) if gathers else opts_here
                plan[path] = ColwiseParallel(**opts, **gather)
            else:
                rep = dict(input_is_parallel=False) if style in ROWWISE_REPLICATED_INPUT else {}
                plan[path] = RowwiseParallel(**opts_here, **rep)
    for path, style in styles.items():
        if style in GRAD_SUM or (style in SEQUENCE and sp):
            plan[path] = SequenceParallel()
    if sp:
        plan[f"{layers}.0"] = ScatterSequence(sequence_dim=1)
        plan.update(checks)
    if head_path is not None and styles.get(head_path) in (*COLWISE, *COLWISE_GATHERED):
        plan[head_path] = ColwiseParallel(**lin_opts, use_local_output=False)
    return _with_wildcards(plan, layers, len(modules[layers]) if layers is not None else 0)


def _vocab_style(emb: nn.Embedding, path: str) -> VocabParallel:
    if type(emb) is nn.Embedding:
        return VocabParallel()
    # transformers' scaled embeddings (Gemma's): the lookup times a buffer, nothing else.
    if type(emb).__name__.endswith("ScaledWordEmbedding") and isinstance(getattr(emb, "embed_scale", None),
                                                                         torch.Tensor):
        return VocabParallel(output_scale="embed_scale")
    raise ValueError(f"parallelize: the input embedding {path!r} is a {type(emb).__name__}, whose forward overlapkit "
                     "does not know; pass plan= (docs/plans.md)")


def _is_mlp(block: str) -> bool:
    return block.rpartition(".")[2] in _MLP_NAMES


def _layers_list(modules: dict, blocks: set, cls: str) -> str | None:
    """The path of the ModuleList of decoder layers that holds every column/row block."""
    lists = set()
    for block in sorted(blocks):
        parts = block.split(".")
        where = [i for i in range(1, len(parts)) if parts[i].isdigit()
                 and isinstance(modules.get(".".join(parts[:i])), nn.ModuleList)]
        if not where:
            return None
        lists.add(".".join(parts[:where[0]]))
    return lists.pop() if len(lists) == 1 else None


def _sp_plan(model, modules: dict, styles: dict, blocks: set, layers: str | None, emb_path, head_path) -> dict:
    """The modules that run on a slice of the sequence under SP and their styles (SequenceParallel; a MoE
    block's router and experts, hf_moe_sp.py), or _SPRefused why not."""
    if layers is None:
        raise _SPRefused("the column/row layers do not all sit in one list of decoder layers")
    if head_path is None or styles.get(head_path) not in (*COLWISE, *COLWISE_GATHERED):
        raise _SPRefused("the output head is not split by the plan (it would need the whole sequence)")
    in_blocks = {m for b in blocks for m in (b, *(f"{b}.{n}" for n, _ in modules[b].named_modules() if n))}
    region: dict = {}
    routers, experts = router_classes(model), set(expert_modules(model))
    moe: dict[str, dict] = {}  # MoE block path -> {"router": child name, "experts": child name}
    layer_list = modules[layers]
    for i, layer in enumerate(layer_list):
        for name, sub in layer.named_modules():
            path = f"{layers}.{i}.{name}" if name else f"{layers}.{i}"
            if path in in_blocks or not _own_params(sub) or any(path.startswith(b + ".") for b in blocks) \
                    or any(path.startswith(e + ".") for e in experts):
                continue
            role = "router" if isinstance(sub, routers) else "experts" if path in experts else None
            if role is not None:
                moe.setdefault(_parent(path), {})[role] = path.rpartition(".")[2]
                continue
            if not _is_per_token(sub):
                raise _SPRefused(f"{path} ({type(sub).__name__}) has parameters and is not known to act per "
                                 "token, so it cannot run on a slice of the sequence")
            region[path] = SequenceParallel()
    for block, parts in moe.items():
        if set(parts) != {"router", "experts"}:
            (role, lone), = parts.items()
            other = "an experts module" if role == "router" else "a router"
            raise _SPRefused(f"{block}.{lone} is the {role} of a MoE block without {other} beside it, so its "
                             "tokens' routing cannot be followed on a slice of the sequence")
        region[block] = MoEBlockSequenceParallel(**parts)
    # After the last layer and before the head (the final norm): the modules of the layers'
    # parent registered after the layer list.
    parent_path = _parent(layers)
    parent = modules[parent_path] if parent_path else model
    after = False
    for name, sub in parent.named_children():
        path = f"{parent_path}.{name}" if parent_path else name
        if path == layers:
            after = True
            continue
        if after and path not in (emb_path, head_path) and any(True for _ in sub.parameters()):
            for sub_name, leaf in sub.named_modules():
                if _own_params(leaf):
                    if not _is_per_token(leaf):
                        raise _SPRefused(f"{path} ({type(leaf).__name__}) runs after the decoder layers and is not "
                                         "known to act per token")
                    region[f"{path}.{sub_name}" if sub_name else path] = SequenceParallel()
    return region


def _with_wildcards(plan: dict, layers: str | None, n_layers: int) -> dict:
    """Entries that are the same for every decoder layer written once, with `*` for the layer index."""
    if layers is None:
        return plan
    pattern = re.compile(re.escape(layers) + r"\.\d+\.")
    grouped: dict[str, list] = {}
    for path, style in plan.items():
        grouped.setdefault(pattern.sub(f"{layers}.*.", path, count=1), []).append((path, style))
    out: dict = {}
    for key, members in grouped.items():
        if "*" in key and len(members) == n_layers and len({repr(s) for _, s in members}) == 1:
            out[key] = members[0][1]
        else:
            out.update(members)
    return out
