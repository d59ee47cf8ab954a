"""ParallelStyles for `torch.distributed.tensor.parallel.parallelize_module`, with overlapkit's overlap modes.

What each style overlaps is what the layer it installs overlaps: `ColwiseParallel` and
`RowwiseParallel` turn an `nn.Linear` into a Column/RowParallelLinear whose all-gather /
reduce-scatter / all-reduce hide behind its GEMMs as `overlap` says (none, bulk, pipelined,
auto). The other styles mark where activations enter and leave the sequence-parallel region
(`ScatterSequence`, `GatherSequence`), which parameters live in it (`SequenceParallel`), and
split an embedding over the vocabulary (`VocabParallel`).

`parallelize_module` does not put a style's return value back into the parent module, so
every style here changes the module in place: the nn.Linear *becomes* the parallel layer
(its class and state are swapped, the hooks registered on it are kept), just as torch's own
styles distribute a module's parameters in place.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.module import _WrappedHook
from torch.distributed.tensor.parallel import ParallelStyle

from ..runtime import comm
from ..runtime.groups import resolve_group
from . import layout, mappings
from .region import decoding, region_of, split_here
from .layers import ColumnParallelLinear, RowParallelLinear, check_overlap
from .sequence_parallel import mark_sequence_parallel
from .vocab import VocabParallelEmbedding


def _become(module: nn.Module, new: nn.Module) -> nn.Module:
    """Make `module` (in place) the module `new` is, keeping the hooks others registered on it.

    `new`'s own hooks (e.g. its state-dict hooks) are carried over and re-bound to `module`, so
    that nothing keeps calling into the discarded object.
    """
    new.train(module.training)
    kept = {k: v for k, v in module.__dict__.items() if "hook" in k and isinstance(v, dict)}
    state = dict(new.__dict__)
    for key, hooks in kept.items():
        for hid, fn in state.get(key, {}).items():
            hooks[hid] = _rebind(fn, new, module)
        state[key] = hooks  # the module's dict objects: handles given out for them still work
    module.__dict__.clear()
    module.__dict__.update(state)
    module.__class__ = new.__class__
    return module


def _rebind(fn, old: nn.Module, module: nn.Module):
    if getattr(fn, "__self__", None) is old:
        return types.MethodType(fn.__func__, module)
    if isinstance(fn, _WrappedHook):
        wrapped = _WrappedHook(_rebind(fn.hook, old, module), module if fn.with_module else None)
        return wrapped
    return fn


def check_unsharded(module: nn.Module, device_mesh, style: str) -> None:
    """A style slices full parameters: refuse DTensors (another mesh, or already sharded) by name."""
    for name, p in module.named_parameters(recurse=False):
        mesh = getattr(p, "device_mesh", None)
        if mesh is None:
            continue
        if mesh != device_mesh:
            raise ValueError(f"{style}: parameter {name!r} of {type(module).__name__} is a DTensor on {mesh}, not on "
                             f"the tensor-parallel mesh {device_mesh}; apply tensor parallelism first, then "
                             "fully_shard / other meshes")
        raise ValueError(f"{style}: parameter {name!r} of {type(module).__name__} is already a DTensor on the "
                         f"tensor-parallel mesh {device_mesh} (placements {p.placements}); parallelize a module once")


def _check_type(module: nn.Module, kind: type, style: str) -> None:
    if type(module) is not kind:
        raise TypeError(f"{style} applies to an {kind.__module__.split('.')[0]}.{kind.__name__}, got "
                        f"{type(module).__name__}")


class _LinearStyle(ParallelStyle):
    """What the column and row styles share: the layer options, and the checks before slicing."""

    def __init__(self, *, overlap: str = "auto", sequence_parallel: bool = False, sequence_dim: int = 0,
                 **layer_kwargs) -> None:
        self.overlap = check_overlap(overlap)
        self.sequence_parallel = sequence_parallel
        self.sequence_dim = sequence_dim
        self.layer_kwargs = layer_kwargs

    def _options(self, name: str) -> dict:
        opts = dict(overlap=self.overlap, sequence_parallel=self.sequence_parallel, name=name, **self.layer_kwargs)
        if self.sequence_dim != 0:  # layers that split dim 0 only (Megatron's [s, b, h]) need not know
            opts["sequence_dim"] = self.sequence_dim
        return opts

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in sorted(self.layer_kwargs.items()))
        return (f"{type(self).__name__}(overlap={self.overlap!r}, sequence_parallel={self.sequence_parallel}, "
                f"sequence_dim={self.sequence_dim}{extra})")


class ColwiseParallel(_LinearStyle):
    """nn.Linear -> ColumnParallelLinear: output features split over TP, this rank's columns out.

    With `sequence_parallel` the input is this rank's slice of `sequence_dim`, all-gathered
    inside the layer (hidden behind the GEMM as `overlap` says). `gather_output` concatenates
    the columns (avoid it for an output head: see `vocab_parallel_cross_entropy`).
    `input_gathered=True`: the input is already the full sequence, all-gathered by a
    `GatherSequence` on an enclosing module whose backward sums the partial input gradients;
    the layer then computes on its shard with no communication of its own.
    `use_local_output=False` returns the output as a DTensor sharded on its last dim (as
    torch's ColwiseParallel does), so that a loss knows it holds a slice of the columns:
    `vocab_parallel_cross_entropy` reads the group from it, and torch's own losses refuse it
    instead of computing a wrong number from a slice.
    """

    def __init__(self, *, overlap: str = "auto", sequence_parallel: bool = False, sequence_dim: int = 0,
                 gather_output: bool = False, input_gathered: bool = False, use_local_output: bool = True,
                 **layer_kwargs) -> None:
        super().__init__(overlap=overlap, sequence_parallel=sequence_parallel, sequence_dim=sequence_dim,
                         **layer_kwargs)
        if input_gathered and sequence_parallel:
            raise ValueError("ColwiseParallel: input_gathered=True computes locally on an already gathered input; "
                             "it does not take sequence_parallel=True")
        if gather_output and not use_local_output:
            raise ValueError("ColwiseParallel: gather_output=True returns whole columns; use_local_output=False "
                             "(a DTensor of this rank's columns) contradicts it")
        self.gather_output, self.input_gathered, self.use_local_output = gather_output, input_gathered, use_local_output
        if gather_output:
            self.layer_kwargs["gather_output"] = True

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        _check_type(module, nn.Linear, "ColwiseParallel")
        check_unsharded(module, device_mesh, "ColwiseParallel")
        # The mesh, not its group: the parameters then live on the caller's (named) mesh dim, which
        # FSDP2's fully_shard over the same root mesh's "dp" dim requires.
        mesh = _one_dim(device_mesh)
        if self.input_gathered:
            opts = dict(overlap="none", sequence_parallel=False, name=_name(module), **self.layer_kwargs)
            _become(module, GatheredInputColumnLinear.from_full(module, mesh, **opts))
        else:
            _become(module, ColumnParallelLinear.from_full(module, mesh, **self._options(_name(module))))
        if not self.use_local_output:
            mesh = _one_dim(device_mesh)  # its group resolved once here: a mesh lookup costs a decode step ~10 µs
            module.register_forward_hook(functools.partial(_as_column_dtensor, mesh, resolve_group(mesh, "tp")))
        return module

    def __repr__(self) -> str:
        return (super().__repr__()[:-1] + f", input_gathered={self.input_gathered}, "
                f"use_local_output={self.use_local_output})")


def _one_dim(device_mesh):
    if device_mesh.ndim == 1:
        return device_mesh
    resolve_group(device_mesh, "tp")  # refuses a mesh without a "tp" dim, naming the dims it has
    return device_mesh["tp"]


def _as_column_dtensor(mesh, group, module, _args, out: torch.Tensor):
    region = region_of(module)
    if region is not None and region.gather_logits:
        # generate(): the next token is chosen from whole-vocabulary logits, as a plain model's.
        return mappings.gather_from_tp(out, group, (module.name or "head") + ".gather_logits")
    if torch.compiler.is_compiling():
        # A compiled graph whose output is a DTensor needing a gradient fails in backward when
        # nothing flows into it (the logits beside a labels= loss: PyTorch #173123, #172556).
        # Compiled, the logits stay this rank's columns as a plain tensor (docs/plans.md).
        return out
    from torch.distributed.tensor import DTensor, Shard
    # run_check=False: the shards differ by construction; no communication.
    return DTensor.from_local(out, mesh, [Shard(out.dim() - 1)], run_check=False)


class RowwiseParallel(_LinearStyle):
    """nn.Linear -> RowParallelLinear: input features split over TP, partial outputs summed.

    The sum is a reduce-scatter over `sequence_dim` with `sequence_parallel`, an all-reduce
    without it; `overlap` says how much of it hides behind the GEMM.
    """

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        _check_type(module, nn.Linear, "RowwiseParallel")
        check_unsharded(module, device_mesh, "RowwiseParallel")
        return _become(module, RowParallelLinear.from_full(module, _one_dim(device_mesh), **self._options(_name(module))))


class GatheredInputColumnLinear(ColumnParallelLinear):
    """A column-parallel linear whose input is already gathered: y = x W_r^T + b_r, nothing sent.

    The input gradient it returns is this rank's partial sum (its output columns only); the
    `GatherSequence` that produced the input reduce-scatters the sum of all such partials in
    backward, once for all the layers that read it (q, k and v of an attention). With
    `gather_output` the columns of every rank are concatenated (an attention that slices a
    fused q/k/v output by fixed offsets needs them all).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if decoding(self):
            return ColumnParallelLinear.forward(self, x)  # one GEMM on the shard, gathered if asked
        # The gathered input is sequence-major (layout.py): read in that order, nothing is copied.
        order = layout.gemm_order(x)
        y = layout.restore(F.linear(layout.as_rows(x, order), self.local(self.weight), self.local(self.bias)), order)
        return mappings.gather_from_tp(y, self.group, self.name + ".out") if self.gather_output else y


class VocabParallel(ParallelStyle):
    """nn.Embedding -> VocabParallelEmbedding: rows (the vocabulary) split over TP, output replicated.

    `output_scale`: the name of a buffer the embedding multiplies its output by (HF's
    `*ScaledWordEmbedding`, an nn.Embedding subclass, scales by `embed_scale`): the buffer is
    kept and the lookup's output scaled by it, as the subclass's forward did.
    """

    def __init__(self, *, output_scale: str | None = None) -> None:
        self.output_scale = output_scale

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if self.output_scale is None:
            _check_type(module, nn.Embedding, "VocabParallel")
        elif not isinstance(module, nn.Embedding) or not isinstance(getattr(module, self.output_scale, None),
                                                                    torch.Tensor):
            raise TypeError(f"VocabParallel(output_scale={self.output_scale!r}) applies to an nn.Embedding with a "
                            f"tensor {self.output_scale!r}, got {type(module).__name__}")
        check_unsharded(module, device_mesh, "VocabParallel")
        scale = getattr(module, self.output_scale) if self.output_scale else None
        layer = VocabParallelEmbedding.from_full(module, _one_dim(device_mesh), name=_name(module))
        _become(module, layer)
        if scale is not None:
            module.register_buffer(self.output_scale, scale, persistent=False)
            module.register_forward_hook(functools.partial(_scale_output, self.output_scale))
        return module

    def __repr__(self) -> str:
        return f"VocabParallel(output_scale={self.output_scale!r})" if self.output_scale else "VocabParallel()"


def _scale_output(buffer: str, module: nn.Module, _args, out: torch.Tensor) -> torch.Tensor:
    return out * getattr(module, buffer).to(out.dtype)


class SequenceParallel(ParallelStyle):
    """The module (a norm) computes on this rank's slice of the sequence; its parameters are replicated.

    Each rank's parameter gradient then covers its tokens only: `mark_sequence_parallel` makes
    autograd sum it over TP before it is accumulated (in a way FSDP2 keeps), so `.grad` is
    complete after backward and no call after it can be forgotten.
    """

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        check_unsharded(module, device_mesh, "SequenceParallel")
        if not any(True for _ in module.parameters(recurse=False)):
            raise ValueError(f"SequenceParallel: {type(module).__name__} has no parameters of its own to mark")
        return mark_sequence_parallel(module, device_mesh, name=_name(module))

    def __repr__(self) -> str:
        return "SequenceParallel()"


class _InputHookStyle(ParallelStyle):
    """Rewrite a module's activation input (its first positional argument, else the keyword `kwarg`)."""

    def __init__(self, *, sequence_dim: int = 0, kwarg: str = "hidden_states") -> None:
        self.sequence_dim, self.kwarg = sequence_dim, kwarg

    def _convert(self, module: nn.Module, x: torch.Tensor, group, name: str) -> torch.Tensor:
        raise NotImplementedError

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        group, name, style = resolve_group(device_mesh, "tp"), _name(module), self

        def hook(mod, args, kwargs):
            if args:
                return (style._convert(mod, args[0], group, name), *args[1:]), kwargs
            if style.kwarg not in kwargs:
                raise ValueError(f"{type(style).__name__} on {name}: no positional input and no {style.kwarg!r} "
                                 f"keyword (got keywords {sorted(kwargs)})")
            return args, {**kwargs, style.kwarg: style._convert(mod, kwargs[style.kwarg], group, name)}

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sequence_dim={self.sequence_dim}, kwarg={self.kwarg!r})"


class ScatterSequence(_InputHookStyle):
    """Enter the sequence-parallel region: keep this rank's slice of `sequence_dim` (all-gather in backward).

    The slice is handed out sequence-major (layout.py). Under overlapkit.parallelize the entry
    also decides, each forward, whether the region splits at all (region.py): a sequence that
    does not split over the ranks (a decode step) passes whole under no_grad.
    """

    def _convert(self, module, x, group, name):
        dim = self.sequence_dim % x.dim()
        ws = comm.group_size(group)
        region = region_of(module)
        if decoding(module):  # the inference layout: the sequence stays whole
            region.active = False
            return x
        if region is not None:
            region.active = x.shape[dim] % ws == 0 or torch.is_grad_enabled()
            if not region.active:
                return x
        mappings.check_divisible(x.shape[dim], ws, f"{name}: sequence length (dim {dim})")
        return mappings.scatter_to_sp(x, group, name + ".enter_sp", dim=dim)


class GatherSequence(_InputHookStyle):
    """Leave the sequence-parallel region at a module's input: all-gather `sequence_dim` (reduce-scatter in backward).

    For a module that needs the whole sequence and reads its length from its input (HF
    attention): its projections are then `ColwiseParallel(input_gathered=True)`.
    """

    def _convert(self, module, x, group, name):
        if not split_here(module):
            return x  # the region is off this forward: the input is the whole sequence already
        return mappings.gather_from_sp(x, group, name + ".gather_sp", dim=self.sequence_dim % x.dim())


def _name(module: nn.Module) -> str:
    # parallelize_module hands styles the module, not its path: the path is recorded beforehand
    # by overlapkit.parallelize (for timeline names); plain parallelize_module gets the class name.
    return getattr(module, "_overlapkit_name", "") or type(module).__name__
