"""What the column- and row-parallel layers share: sizes, mesh and group, overlap mode, parameters, checks.

Each layer's forward picks its path here (none, bulk, pipelined, or the cost model's choice under
auto, per input shape) and runs it through `ops.linear`; layers.py holds the two layers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime import comm
from ..runtime.agreement import Agreement, agree, report_problem
from ..vocabulary import OVERLAP_MODES, check_bool, positive_int
from . import layout, ops
from .collectives import all_reduce_copy
from .mappings import check_divisible
from .params import LocalShardParams, make_param, mesh_and_group
from .pipelined import _check_transport, _chunks_per_rank, check_layer_options
from .precision import autocast_dtype, autocast_off, cast
from .region import SequenceRegion

OPTIONS = ("overlap", "transport", "chunks", "save_gathered_input", "sequence_parallel", "sequence_dim")
"""The layers' options that may be changed after construction (each is validated when set)."""


def check_overlap(overlap: str, allowed=OVERLAP_MODES) -> str:
    """`overlap`, or a ValueError naming it unless it is one of `allowed`."""
    if overlap not in allowed:
        raise ValueError(f"overlap={overlap!r} is not one of {allowed}")
    return overlap


def local_of(p: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor a forward without gradients computes with: a DTensor's local tensor, else `p` itself."""
    return getattr(p, "_local_tensor", p)


def _check_input(layer: nn.Module, shape, x_dtype, x_device, w_dtype, w_device, in_features: int,
                 sp_split: bool) -> None:
    """Shape (sequence dim first), dtype and device checks, before any collective so every rank fails alike."""
    name = layer.name or type(layer).__name__
    if len(shape) < 2:
        raise ValueError(f"{name}: input must have at least 2 dims [tokens, hidden], got shape {tuple(shape)}")
    if shape[-1] != in_features:
        raise ValueError(f"{name}: input's last dim is {shape[-1]}, expected {in_features}")
    if x_dtype != w_dtype:
        raise ValueError(f"{name}: input dtype {x_dtype} differs from the weight dtype {w_dtype}")
    if x_device != w_device:
        raise ValueError(f"{name}: input is on {x_device}, the weight on {w_device}")
    if sp_split:
        check_divisible(shape[0], layer.tp_size, f"{name}: sequence length (dim {layer.sequence_dim})")


@torch.compiler.assume_constant_result
def _choose_tp_overlap(m: int, k: int, n: int, tp: int, elem: int, hardware: str, collective: str, transport: str):
    """The cost model's (mode, chunks): a function of static shapes, so torch.compile runs it once
    while tracing and keeps the answer as a constant (it reads preset files dynamo cannot trace)."""
    from ..costmodel import choose_tp_overlap
    return choose_tp_overlap(m, k, n, tp, elem, hardware, comm=collective, transport=transport)


class ParallelLinear(LocalShardParams, nn.Module):
    """What the column and row layers share: sizes, mesh and group, overlap mode, parameters, checks."""

    _split_dim: int
    _direct = True
    """False where `_linear` does more than the linear (a row layer scattering a replicated input)."""
    """Dim of the [out, in] weight split over TP (0: column, 1: row)."""

    def __init__(self, in_features: int, out_features: int, mesh_or_group, *, bias: bool,
                 sequence_parallel: bool, sequence_dim: int, overlap: str, name: str, device, dtype,
                 transport: str = "p2p", chunks: int | None = None, save_gathered_input: bool = False,
                 hardware: str = "h200-sxm", **flags: bool) -> None:
        super().__init__()
        self.mesh, self.group = mesh_and_group(mesh_or_group)
        self.tp_size, self.tp_rank = comm.group_size(self.group), comm.group_rank(self.group)
        label = name or type(self).__name__
        # Ranks built with different arguments would pair unrelated collectives later: compare
        # them now, before validating, so a bad value on one rank fails on every rank.
        agree(self.group, f"{type(self).__name__}({name})", in_features=in_features, out_features=out_features,
              bias=bias, sequence_parallel=sequence_parallel, sequence_dim=sequence_dim, overlap=overlap,
              transport=transport, chunks=chunks, save_gathered_input=save_gathered_input, hardware=hardware,
              dtype=dtype, device_type=torch.device(device).type if device is not None else None, **flags)
        positive_int(in_features, f"{label}: in_features")
        positive_int(out_features, f"{label}: out_features")
        for field, value in dict(bias=bias, **flags).items():
            check_bool(value, f"{label}: {field}")
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.overlap, self.transport, self.chunks, self.save_gathered_input = overlap, transport, chunks, \
            save_gathered_input
        self.hardware = hardware
        self.name = name
        self._validate_options()
        self.sequence_region: SequenceRegion | None = None
        """Set by overlapkit.parallelize: whether this forward's sequence is split (layout.py, region.py)."""
        self.fused_reduce = False
        """Row layer in the inference layout (region.decode): return the partial sum unreduced and without
        the bias, because the caller all-reduces it fused with its residual add and norm (set by
        overlapkit.models.prepare_decode for the row layers whose decoder layer does that)."""
        self.auto_choices: dict[tuple, tuple[str, int | None]] = {}
        """overlap='auto': input shape -> (mode, chunks) the cost model chose for it."""
        self._agreement = Agreement(f"{type(self).__name__}({name})")
        self._calls: dict[tuple, tuple] = {}
        """Input signature -> what `_new_call` returned for it (every check passed, ranks agreed)."""
        self._init_state_dict_hooks()

    def _validate_options(self) -> None:
        label = self.name or type(self).__name__
        for field in ("sequence_parallel", "save_gathered_input"):
            check_bool(getattr(self, field), f"{label}: {field}")
        if isinstance(self.sequence_dim, bool) or not isinstance(self.sequence_dim, int):
            raise ValueError(f"{label}: sequence_dim={self.sequence_dim!r} must be an integer (the activation's "
                             "sequence dim: 0 for [seq, batch, hidden], 1 for [batch, seq, hidden])")
        check_overlap(self.overlap)
        check_layer_options(self.overlap, self.sequence_parallel, self.transport, self.chunks, self.tp_size,
                            self.save_gathered_input)

    def __setattr__(self, name: str, value) -> None:
        # An option changed after construction is checked when set (a typo in `overlap` must
        # not run silently as another mode); ranks that change it differently are caught by the
        # comparison at the next forward (the signature holds every option).
        if name in OPTIONS and "_calls" in self.__dict__:
            old = self.__dict__[name]
            super().__setattr__(name, value)
            try:
                self._validate_options()
            except ValueError as e:
                super().__setattr__(name, old)
                # Set on one rank only, perhaps: its peers, waiting at the next forward, hear why it left.
                report_problem(self.group, self.name or type(self).__name__, f"{name}={value!r} refused: {e}")
                raise
            return
        super().__setattr__(name, value)

    def _make_params(self, bias: bool, device, dtype) -> None:
        """DTensor weight and bias on the TP mesh; initialized like nn.Linear unless on meta."""
        full_w = (self.out_features, self.in_features)
        local_w = list(full_w)
        local_w[self._split_dim] //= self.tp_size
        w_place, b_place = self._param_placements()
        self._placements["weight"] = w_place
        self.weight = make_param(torch.empty(local_w, device=device, dtype=dtype), self.mesh, w_place, full_w)
        if bias:
            b_local = self.out_features // (self.tp_size if self._split_dim == 0 else 1)
            self._placements["bias"] = b_place
            self.bias = make_param(torch.empty(b_local, device=device, dtype=dtype), self.mesh, b_place,
                                   (self.out_features,))
        else:
            self.register_parameter("bias", None)
        if self.local_data("weight").device.type != "meta":
            self.reset_parameters()

    def _param_placements(self):
        from torch.distributed.tensor import Replicate, Shard
        return [Shard(self._split_dim)], [Shard(0) if self._split_dim == 0 else Replicate()]

    def _global_shape(self, name: str):
        return (self.out_features, self.in_features) if name == "weight" else (self.out_features,)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """nn.Linear's init drawn for the FULL weight and bias, this rank keeping its shard.

        So a layer seeded like an unsharded nn.Linear holds exactly that layer's shard (every
        rank draws the same full tensors: seed them alike); after `to_empty` from meta, too.
        """
        w = self.local_data("weight")
        if w.device.type == "meta":
            raise RuntimeError(f"{self.name or type(self).__name__}: parameters are on meta; materialize them "
                               "with to_empty(device=...) before reset_parameters()")
        full = torch.empty(self.out_features, self.in_features, device=w.device, dtype=w.dtype)
        nn.init.kaiming_uniform_(full, a=math.sqrt(5))
        w.copy_(self.shard_of(full))
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.in_features)
            full_b = torch.empty(self.out_features, device=w.device, dtype=w.dtype).uniform_(-bound, bound)
            self.local_data("bias").copy_(self.shard_of(full_b))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer on x. A new input signature runs every check and the cross-rank comparison
        (`_new_call`); a seen one is one dict lookup, then the linear on the parameters themselves."""
        region = self.sequence_region
        # The flag outlives its forward: a later call of this layer alone, with gradients, must not take it.
        if region is not None and region.decode and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
            return self.decode_forward(x)
        cdt = autocast_dtype(x)
        w, b = self.weight, self.bias
        if torch.compiler.is_compiling():
            if self.tp_size == 1:
                # One rank: nothing moves, so the layer is nn.Linear, which inductor can fuse
                # with its neighbours (an opaque op would stand between them).
                return F.linear(x, self.local(w), self.local(b))
            # Traced once per shape: the checks run while tracing; the ops compare signatures
            # across ranks at run time (a store round trip cannot be traced; see ops.py).
            sp = self.sequence_parallel and (self.sequence_region is None or self.sequence_region.active)
            order, _, args = self._new_call(x, w, cdt, sp, agree=False)
            return self._run(x, order, args, cdt, cast(self.local(w), cdt), cast(self.local(b), cdt), ops.compiled)
        sp = self.sequence_parallel and (self.sequence_region is None or self.sequence_region.active)
        key = (x.shape, x.stride(), x.dtype, w.dtype, cdt, torch.is_grad_enabled(), x.requires_grad, self.overlap,
               self.chunks, sp, self.sequence_dim, self.transport)
        call = self._calls.get(key)
        if call is None:
            call = self._new_call(x, w, cdt, sp, agree=True)
            self._calls[key] = call  # only once every check has passed
        order, copies, args = call
        if order is not None or copies or cdt is not None or not self._direct:
            return self._run(x, order, args, cdt, w, b, None)
        return ops.eager(x, w, b, None, args)  # the common case, without _run's steps

    def decode_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The inference layout (no gradient, the sequence whole on every rank): one GEMM on this rank's
        shard, read from the local tensors with no DTensor or autograd step on the way.

        A column layer communicates nothing (ColumnParallelLinear.forward gathers after it where asked);
        a row layer all-reduces its partial sum, or, with `fused_reduce`, returns it for the caller's
        fused all-reduce."""
        w, b = self.decode_locals()
        if self._kind == "column":
            return F.linear(x, w, b)
        if not self.input_is_parallel:
            x = x.chunk(self.tp_size, dim=-1)[self.tp_rank]
        y = F.linear(x, w)
        if self.fused_reduce:
            return y
        y = all_reduce_copy(y, self.group, self.name + ".fwd")
        return y if b is None else y + b

    def decode_locals(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, bias) as this rank's local tensors, for forwards without gradients: a DTensor
        parameter's local tensor, a plain parameter itself. Each is the object the parameter holds now
        (read in one attribute look-up), so a parameter replaced or converted since (FSDP, `.to()`,
        which swaps a DTensor parameter's contents) is always seen."""
        params = self._parameters
        return local_of(params["weight"]), local_of(params.get("bias"))

    def _run(self, x, order, args: tuple, cdt, w, b, compiled) -> torch.Tensor:
        """The linear on x read in `order` (layout.gemm_order), returned in x's order as a view of that layout.

        `compiled` is ops.compiled (w, b local shards) or None (eager: the parameters)."""
        x = layout.as_rows(x, order)
        if cdt is None:
            y = self._linear(x, w, b, args, cdt, compiled)
        else:
            x = cast(x, cdt)
            with autocast_off(x, cdt):
                y = self._linear(x, w, b, args, cdt, compiled)
        return layout.restore(y, order)

    def _linear(self, x, w, b, args: tuple, cdt, compiled) -> torch.Tensor:
        return ops.eager(x, w, b, cdt, args) if compiled is None else compiled(x, w, b, args)

    def _new_call(self, x: torch.Tensor, w: torch.Tensor, cdt, sp: bool, *, agree: bool) -> tuple:
        """(the order the GEMM reads x in, whether that copies x, the ops' static args) for a new input,
        after every check. `sp`: whether the sequence is split in this forward (region.py).

        Compared across the ranks first (a store round trip), so that a mismatch fails on every rank.
        The checks and the mode see the input with its sequence dim first (what the collectives cut);
        the GEMM reads it in that order only where rows travel by sequence (layout.py), else in the
        order it already lies in.
        """
        label = self.name or type(self).__name__
        if agree:
            self._agreement.check(self.group, shape=tuple(x.shape), dtype=x.dtype, autocast=cdt,
                                  grad_enabled=torch.is_grad_enabled(), requires_grad=x.requires_grad,
                                  overlap=self.overlap, chunks=self.chunks, sequence_parallel=sp,
                                  sequence_dim=self.sequence_dim, transport=self.transport,
                                  in_features=self.in_features, out_features=self.out_features)
        sd = 0
        if sp:
            sd = self.sequence_dim + x.dim() if self.sequence_dim < 0 else self.sequence_dim
            if not 0 <= sd <= x.dim() - 2:
                raise ValueError(f"{label}: sequence_dim={self.sequence_dim} is not a dim of the {x.dim()}-D input "
                                 f"{tuple(x.shape)} other than the last (hidden)")
        shape = x.movedim(sd, 0).shape if sd else x.shape
        dtype = cdt or x.dtype
        scatters = sp and self._kind == "row"
        _check_input(self, shape, dtype, x.device, cdt or w.dtype, w.device, self._expected_in, scatters)
        # Without a split sequence there is nothing to pipeline: the region is off (a decode step).
        mode, chunks = self._mode(shape, dtype, sp, *self._gemm(shape, sp)) if sp or self.overlap != "pipelined" \
            else ("none", None)
        kind = self._kind
        k, transport, save = 1, "p2p", False
        if mode == "pipelined":
            rows = shape[0] // self.tp_size if scatters else shape[0]
            k = _chunks_per_rank(chunks, self.tp_size, rows, 0)
            _check_transport(self.transport, self.group, x.device)
            kind, transport = kind + "_pipelined", self.transport
            save = self.save_gathered_input and kind == "column_pipelined"
        if mode == "bulk" or ops.bulk_column_backward(kind, transport):
            comm.warn_if_max_connections_unsuited(x.device)  # both issue asynchronous collectives in backward
        name = (self.name or self._kind) if mode == "pipelined" else self.name
        order = layout.gemm_order(x, sd if sp and self.tp_size > 1 else None)
        return order, layout.needs_copy(x, order), (kind, self.group, sp, mode == "bulk", k, transport, save, name)

    def _mode(self, shape, dtype, sp: bool, m: int, k: int, n: int, collective: str, rows_per_rank: int):
        """(mode, chunks) for an input of `shape` (sequence dim first) in the GEMM's `dtype`, of an
        [m, k] x [k, n] GEMM (`sp`: the sequence is split): the fixed setting, or the cost model's
        pick under auto."""
        if self.overlap != "auto":
            return self.overlap, self.chunks
        key = (tuple(shape), dtype)
        if key not in self.auto_choices:
            from ..costmodel import ConfigError
            try:
                mode, chunks = _choose_tp_overlap(m, k, n, self.tp_size, dtype.itemsize, self.hardware,
                                                  collective, self.transport)
            except ConfigError as e:
                raise ValueError(f"{self.name or type(self).__name__}: overlap='auto': {e}") from None
            if mode == "pipelined" and not sp:
                mode = "bulk"  # only the sequence-parallel collectives can be chunked
            # The model counts chunks over all ranks; keep them only if they split this shard evenly.
            ok = mode == "pipelined" and chunks % self.tp_size == 0 and rows_per_rank % (chunks // self.tp_size) == 0
            self.auto_choices[key] = (mode, chunks if ok else None)
        return self.auto_choices[key]

    @classmethod
    def from_full(cls, linear: nn.Linear, mesh_or_group, **kwargs):
        """This rank's shard of an unsharded nn.Linear (same dtype and device); kwargs go to the layer.

        Built on meta and filled from `linear`, so no random init is drawn (nor RNG consumed).
        """
        layer = cls(linear.in_features, linear.out_features, mesh_or_group, bias=linear.bias is not None,
                    device="meta", dtype=linear.weight.dtype, **kwargs)
        layer.to_empty(device=linear.weight.device)
        with torch.no_grad():
            layer.local_data("weight").copy_(layer.shard_of(linear.weight))
            if linear.bias is not None:
                layer.local_data("bias").copy_(layer.shard_of(linear.bias))
        return layer

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.tp_size}, "
                f"sp={self.sequence_parallel}, sequence_dim={self.sequence_dim}, overlap={self.overlap!r}")
