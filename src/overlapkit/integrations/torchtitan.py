"""torchtitan's Llama 3 trained by overlapkit's engines, through torchtitan's own extension point.

torchtitan (0.3) picks a model by `--module M --config F`: it imports `M.config_registry` (or `M`
itself) and calls `F()`, a `Trainer.Config` whose `model_spec.parallelize_fn` the trainer calls as
`parallelize_fn(model, *, parallel_dims, training, parallelism, compile_config, ac_config,
dump_folder)`. This module is such an `M`: `--module overlapkit.integrations.torchtitan --config
llama3_debugmodel` (any `llama3_*` config of torchtitan's Llama 3 registry) is torchtitan's own
config with `parallelize_llama3` swapped in, so the user's TOML/CLI overrides stay as they are.

`parallelize_llama3` applies overlapkit's tensor parallelism on the "tp" mesh dim (the plan below:
overlapkit's column/row layers, whose overlap mode hides each GEMM's collective) and overlapkit's
`fully_shard` (FSDP2 with overlapkit's prefetch) on the "fsdp" dim, one unit per layer and one for
`lm_head` (torchtitan's chunked loss calls it on its own), gradients summed over dp as torchtitan's
loss (a token sum over the global token count) expects. torchtitan builds the model on
the meta device and initializes it after parallelize_fn; overlapkit's layers replace torchtitan's
Linear modules (and with them torchtitan's per-module init), so the model is materialized and
initialized whole first (the same on every rank: global rank 0's weights), then sliced; the
trainer's later `to_empty` becomes a move and its `init_weights` a no-op for this model.

torchtitan is imported only inside functions: importing overlapkit never needs it.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

from ..data_parallel import fully_shard
from ..models.parallelize import parallelize
from ..tensor_parallel.styles import ColwiseParallel, RowwiseParallel, VocabParallel

SPEC_NAME = "overlapkit_llama3"
"""The ModelSpec name the swapped-in configs carry (torchtitan logs it as the model's name)."""


def llama3_plan(model: nn.Module, tp: int, *, overlap: str = "auto", **layer_kwargs) -> dict:
    """The TP plan of torchtitan's Llama 3 (`Decoder`: tok_embeddings, layers.N.attention
    .qkv_linear.wqkv (fused) or .wq/.wk/.wv, attention.wo, feed_forward.w1/w2/w3, norm, lm_head).

    Without sequence parallelism: norms and residuals hold the whole sequence, so torchtitan's loss
    (which may call `lm_head` on chunks of the final hidden state) sees whole rows. The fused wqkv's
    output dim is laid out [n_kv_heads, q-heads-per-kv + 2, head_dim] and its forward reshapes with
    -1 heads, so a contiguous column split gives each rank whole KV groups. `lm_head` all-gathers
    its vocabulary columns, so torchtitan's cross-entropy sees whole logits.
    """
    attn = next((m for n, m in model.named_modules() if n.endswith("attention") and hasattr(m, "n_heads")), None)
    if attn is None:
        raise ValueError(f"llama3_plan: {type(model).__name__} has no layers.N.attention with n_heads")
    sizes = {"n_heads": attn.n_heads, "n_kv_heads": getattr(attn, "n_kv_heads", None) or attn.n_heads,
             "vocab_size": model.lm_head.out_features, "hidden_dim": model.layers["0"].feed_forward.w1.out_features}
    for field, value in sizes.items():
        if value % tp:
            raise ValueError(f"llama3_plan: {field}={value} is not divisible by the tensor-parallel size {tp}")
    lin = dict(overlap=overlap, **layer_kwargs)
    plan = {"tok_embeddings": VocabParallel()}
    fused = any(n.endswith("qkv_linear.wqkv") for n, _ in model.named_modules())
    for w in (("wqkv",) if fused else ("wq", "wk", "wv")):
        plan[f"layers.*.attention.qkv_linear.{w}"] = ColwiseParallel(**lin)
    plan["layers.*.attention.wo"] = RowwiseParallel(**lin)
    plan["layers.*.feed_forward.w1"] = ColwiseParallel(**lin)
    plan["layers.*.feed_forward.w3"] = ColwiseParallel(**lin)
    plan["layers.*.feed_forward.w2"] = RowwiseParallel(**lin)
    plan["lm_head"] = ColwiseParallel(**lin, gather_output=True)
    return plan


def parallelize_transformer(model: nn.Module, tp_mesh=None, dp_mesh=None, *, dp_dim: str = "fsdp",
                            overlap: str = "auto", mp_policy=None, before_shard=None, wrap=None) -> nn.Module:
    """overlapkit's TP on `tp_mesh` (a 1-D mesh, or None/size 1 for none) by `llama3_plan`, then
    `before_shard(model)` if given, then overlapkit's `fully_shard` on `dp_dim` of `dp_mesh` (a mesh
    holding that dim and, with TP, the "tp" dim; None for none), its units `wrap` (fully_shard's). In place; returns `model`.
    Collective over every rank of the meshes."""
    if tp_mesh is not None and tp_mesh.size() > 1:
        tp = tp_mesh.size()
        parallelize(model, tp_mesh, plan=llama3_plan(model, tp, overlap=overlap))
        # parallelize traces where parameters sit between column and row layers at the first
        # forward (models/plan_edges.py); under fully_shard that forward would see FSDP2's unsharded
        # parameters, so it runs here, on a few tokens, before anything is sharded over dp.
        with torch.enable_grad():
            model(torch.zeros(1, 2 * tp, dtype=torch.long, device=next(model.parameters()).device))
    if before_shard is not None:
        before_shard(model)
    if dp_mesh is not None:
        fully_shard(model, dp_mesh, dim=dp_dim, overlap=overlap, mp_policy=mp_policy, wrap=wrap)
    return model


def materialize(model: nn.Module, device, buffer_device=None) -> None:
    """A meta-device torchtitan model made real and initialized by its own `init_weights`, with
    global rank 0's values on every rank (a rank seeded otherwise would hold other shards)."""
    if not any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=buffer_device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            for t in (*model.parameters(), *model.buffers()):
                dist.broadcast(t.data, src=0)


def _keep_initialized(model: nn.Module) -> None:
    """After slicing: the trainer's `to_empty(device=...)` keeps the initialized shards (they are on
    that device already; another device is a ValueError) instead of wiping them, and its
    `init_weights` (whose per-module init skips overlapkit's layers) does nothing."""
    here = {p.device for p in model.parameters()}

    def to_empty(*, device, recurse=True):
        if {torch.device(device).type} != {d.type for d in here}:
            raise ValueError(f"parallelize_llama3: the model was initialized on {sorted(map(str, here))}, "
                             f"the trainer asks for {device} (CPU offload is not supported)")
        return model

    model.to_empty = to_empty
    model.init_weights = lambda *args, **kwargs: None


def _refuse(model, parallel_dims, training, compile_config, parallelism) -> None:
    unsupported = [name for name in ("pp_enabled", "cp_enabled", "ep_enabled", "dp_replicate_enabled")
                   if getattr(parallel_dims, name, False)]
    if getattr(model, "enable_weight_tying", False) and getattr(parallel_dims, "dp_shard_enabled", False):
        # tok_embeddings and lm_head share a weight, and lm_head is an FSDP unit of its own here
        unsupported.append("enable_weight_tying with fsdp")
    if compile_config is not None and getattr(compile_config, "enable", False):
        unsupported.append("compile.enable")
    if training is not None and getattr(training, "enable_cpu_offload", False):
        unsupported.append("training.enable_cpu_offload")
    if unsupported:
        raise ValueError(f"overlapkit's torchtitan parallelize supports tp and fsdp only; these are on: {unsupported} "
                         "(use torchtitan's own --module llama3 for them)")
    if parallelism is not None and getattr(parallelism, "enable_sequence_parallel", False) \
            and parallel_dims.tp_enabled:
        warnings.warn("overlapkit's torchtitan plan runs tensor parallelism without sequence parallelism "
                      "(parallelism.enable_sequence_parallel is not applied)", stacklevel=3)


def parallelize_llama3(model: nn.Module, *, parallel_dims, training=None, parallelism=None, compile_config=None,
                       ac_config=None, dump_folder: str = "", overlap: str = "auto") -> nn.Module:
    """torchtitan's `parallelize_fn` with overlapkit's engines: TP on "tp", fully_shard on "fsdp".

    Refuses (ValueError) pipeline, context, expert and replicated data parallelism, compile,
    CPU offload and tied embeddings under fsdp;
    applies torchtitan's activation checkpointing when `ac_config` is given and the mixed precision
    of `training` (param/reduce dtypes) through fully_shard.
    """
    _refuse(model, parallel_dims, training, compile_config, parallelism)
    # torchtitan's init device: its accelerator's current one (the trainer set it), else the CPU
    device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    device = torch.device("cpu") if device is None else \
        torch.device(device.type, torch.accelerator.current_device_index())
    materialize(model, device, buffer_device=device)
    tp_mesh = parallel_dims.get_mesh("tp") if parallel_dims.tp_enabled else None
    dp_mesh = None
    if parallel_dims.dp_shard_enabled:
        dp_mesh = parallel_dims.get_mesh(["fsdp", "tp"] if tp_mesh is not None else "fsdp")
    mp_policy = None
    if training is not None and dp_mesh is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        # torchtitan names the dtypes as torch does ("bfloat16", "float32": its TORCH_DTYPE_MAP)
        mp_policy = MixedPrecisionPolicy(param_dtype=getattr(torch, training.mixed_precision_param),
                                         reduce_dtype=getattr(torch, training.mixed_precision_reduce))
    # activation checkpointing as torchtitan's parallelize_llama applies it: after TP, before FSDP
    ac = None if ac_config is None else (lambda m: ac_config.build(dump_folder=dump_folder).apply(m))
    parallelize_transformer(model, tp_mesh, dp_mesh, overlap=overlap, mp_policy=mp_policy, before_shard=ac,
                            wrap=["layers", "lm_head"])
    if dp_mesh is not None:
        # torchtitan's loss is each rank's token sum over the global token count and its FSDP sums
        # gradients (torchtitan.distributed.fsdp.disable_fsdp_gradient_division): averaging them
        # here would make every gradient dp times too small.
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                # a plain SUM (else PREMUL_SUM(1.0), which gloo lacks)
                module.set_force_sum_reduction_for_comms(True)
    _keep_initialized(model)
    return model


def with_overlapkit(config, *, name: str = SPEC_NAME):
    """A torchtitan `Trainer.Config` whose model is parallelized by `parallelize_llama3`, named `name`;
    everything else (model config, tokenizer, loss, optimizer, data) is the one given."""
    import dataclasses

    config.model_spec = dataclasses.replace(config.model_spec, name=name, parallelize_fn=parallelize_llama3,
                                            pipelining_fn=None)
    return config


def register(config_name: str = "llama3_debugmodel", *, name: str = SPEC_NAME):
    """The `Trainer.Config` torchtitan's Llama 3 registry gives for `config_name`, with overlapkit's
    parallelize swapped in (`with_overlapkit`). `--config <config_name>` with `--module
    overlapkit.integrations.torchtitan` reaches this through the module's `__getattr__`."""
    from torchtitan.models.llama3 import config_registry

    build = getattr(config_registry, config_name, None)
    if not callable(build):
        known = sorted(n for n in dir(config_registry) if n.startswith("llama3_"))
        raise ValueError(f"register: torchtitan's Llama 3 registry has no config {config_name!r} (it has {known})")
    return with_overlapkit(build(), name=name)


def __getattr__(name: str):
    # torchtitan's config manager does getattr(module, --config): every llama3_* config of its
    # registry is offered here with overlapkit's parallelize.
    if name.startswith("llama3_"):
        return lambda: register(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
