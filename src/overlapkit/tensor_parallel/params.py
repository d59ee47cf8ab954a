"""DTensor parameters for layers that compute on local shards: the TP mesh, creation, state dict, local views.

Nothing here overlaps anything. It makes the parallel layers citizens of PyTorch's parallel
stack: their parameters are DTensors on the TP mesh dim with the placements that say how
they are split, so `state_dict()` tells DCP, FSDP2 and `full_tensor()` the truth, while the
overlapped autograd functions compute on the local shards and never go through DTensor dispatch:
they take the parameters themselves (`param_parts`) and return their gradients as DTensors of
the parameters' specs (`grad_as_param`), which costs less host time than `to_local()`'s backward.

`LocalShardParams` is the mixin that holds that contract (part of the vocabulary-parallel
layers use it too): `local(p)` in forward, `load_state_dict` accepting a full plain tensor
(it is sharded) or a DTensor on the same mesh (it is redistributed), and
`localize_parameters` for engines that need plain tensors (our DataParallel's flat gradient
buffer): the parameters become their local shards and `state_dict()` still returns DTensors.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..runtime import state
from ..runtime.deprecation import deprecated

_meshes: dict[str, object] = state.cache_dict("tp.meshes_of_groups")
"""1-D DeviceMeshes built from bare ProcessGroups, by group name: one per group, shared by layers."""


@functools.cache
def _dtensor():
    from torch.distributed.tensor import DTensor, Replicate, Shard
    return DTensor, Replicate, Shard


def is_dtensor(t) -> bool:
    if torch.compiler.is_compiling():  # dynamo warns at every compile when it traces a functools.cache
        from torch.distributed.tensor import DTensor
        return isinstance(t, DTensor)
    return isinstance(t, _dtensor()[0])


def tp_mesh(mesh):
    """The 1-D tensor-parallel DeviceMesh of a DeviceMesh (its "tp" dim), a ParallelGroups or a ProcessGroup.

    What `parallelize` and a `parallelize_module` plan take; its group is `tp_mesh(x).get_group()`.
    """
    from torch.distributed.device_mesh import DeviceMesh

    from ..runtime.groups import ParallelGroups

    if isinstance(mesh, ParallelGroups):
        if mesh.mesh is None:
            raise ValueError("tp_mesh: this ParallelGroups has no DeviceMesh; build it with ParallelGroups.build "
                             "or overlapkit.init")
        mesh = mesh.mesh
    if isinstance(mesh, dist.ProcessGroup):
        device = "cuda" if dist.get_backend(mesh) == "nccl" else "cpu"
        return DeviceMesh.from_group(mesh, device, mesh_dim_names=("tp",))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"tp_mesh: expected a DeviceMesh with a 'tp' dim, a ParallelGroups or a ProcessGroup, "
                        f"got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    if "tp" in names:
        return mesh["tp"] if mesh.ndim > 1 else mesh
    if mesh.ndim == 1 and not names:
        return mesh  # an unnamed 1-D mesh is the TP mesh, as parallelize_module takes it
    raise ValueError(f"tp_mesh: the DeviceMesh has dims {names or '(unnamed)'} of sizes {tuple(mesh.shape)}; "
                     "tensor parallelism needs a dim named 'tp' (e.g. init_device_mesh(..., mesh_dim_names=('dp', 'tp')))")


def tp_mesh_and_group(mesh_or_group):
    """The earlier spelling (a DeprecationWarning once): (the layers' TP mesh or None, their group or None).
    Use `tp_mesh(x)`, and `tp_mesh(x).get_group()` for the group."""
    deprecated("tensor_parallel.tp_mesh_and_group(x)", "tensor_parallel.tp_mesh(x) (its group: mesh.get_group())")
    return mesh_and_group(mesh_or_group)


def mesh_and_group(mesh_or_group):
    """The TP layers' (1-D TP DeviceMesh or None, ProcessGroup or None) for a mesh, a mesh with a "tp" dim, groups or a group.

    A ParallelGroups or an N-D mesh gives its "tp" sub-mesh, so that DTensors of the TP layers
    share a root mesh with FSDP2's `mesh["dp"]` (FSDP2 requires it for 2-D). A bare
    ProcessGroup gets a 1-D mesh built over it (`DeviceMesh.from_group`). None means the world,
    or a single process without torch.distributed (plain parameters, no communication).
    """
    from torch.distributed.device_mesh import DeviceMesh

    from ..runtime.groups import ParallelGroups, resolve_group

    group = resolve_group(mesh_or_group, "tp")  # validates: a mesh without a "tp" dim is refused here
    if group is None:
        return None, None
    if isinstance(mesh_or_group, DeviceMesh):
        return (mesh_or_group if mesh_or_group.ndim == 1 else mesh_or_group["tp"]), group
    if isinstance(mesh_or_group, ParallelGroups) and mesh_or_group.mesh is not None:
        return mesh_or_group.mesh["tp"], group
    name = group.group_name
    if name not in _meshes:
        device_type = "cuda" if str(dist.get_backend(group)) == "nccl" else "cpu"
        _meshes[name] = DeviceMesh.from_group(group, device_type)
    return _meshes[name], group


def param_parts(p: torch.Tensor | None):
    """(spec or None, local tensor) of a parameter: what `grad_as_param` needs, read once in forward."""
    if p is None:
        return None, None
    return (p._spec, p._local_tensor) if is_dtensor(p) else (None, p)


def grad_as_param(g: torch.Tensor | None, spec, local: torch.Tensor) -> torch.Tensor | None:
    """The local gradient `g` of a parameter as the parameter's gradient: a DTensor of its `spec` if it has one.

    (spec, local) come from `param_parts`. The gradient gets the parameter's dtype and local
    strides, so the spec (global shape and stride) describes it exactly; reusing the spec skips
    what `DTensor.from_local` costs in backward (a new spec, its copy and shard-order checks).
    """
    if g is None:
        return None
    if g.dtype != local.dtype:
        g = g.to(local.dtype)  # the GEMM ran in the autocast dtype; the gradient returns in the parameter's
    if spec is None:
        return g
    if g.stride() != local.stride():
        g = g.new_empty_strided(local.shape, local.stride()).copy_(g)
    # __new__ alone: DTensor.__init__ does nothing but sits under dynamo/export wrappers (~5 µs).
    # (local_tensor, spec, *, requires_grad) is the signature on torch 2.11 and 2.13 alike.
    dtensor = _dtensor()[0]
    return dtensor.__new__(dtensor, g, spec, requires_grad=g.requires_grad)


class _LocalShard(torch.autograd.Function):
    """A DTensor parameter's local shard in forward; its gradient as a DTensor of the same spec in backward.

    What `DTensor.to_local()` does, for a fraction of its backward's host cost (see grad_as_param).
    """

    @staticmethod
    def forward(ctx, p):
        ctx.parts = param_parts(p)
        ctx.set_materialize_grads(False)
        local = p._local_tensor
        return local.view_as(local)  # a fresh tensor object: autograd writes its metadata into it

    @staticmethod
    def backward(ctx, g):
        return grad_as_param(g, *ctx.parts)


def make_param(local: torch.Tensor, mesh, placements: Sequence, global_shape: Sequence[int]) -> nn.Parameter:
    """nn.Parameter of the DTensor whose local shard is `local` (a plain Parameter without a mesh)."""
    if mesh is None:
        return nn.Parameter(local)
    DTensor, _, _ = _dtensor()
    full = torch.empty(global_shape, device="meta")  # only for the global stride
    return nn.Parameter(DTensor.from_local(local, mesh, list(placements), run_check=False,
                                           shape=torch.Size(global_shape), stride=full.stride()))


class LocalShardParams:
    """Mixin: parameters are DTensors (or plain local shards, see `localize_parameters`).

    A subclass sets `self.mesh` (1-D TP mesh or None) and fills `self._placements`
    (parameter name -> placements) and implements `shard_of(full)` (this rank's slice of a full
    parameter) and `_global_shape(name)`.
    """

    mesh = None
    _placements: dict

    def _init_state_dict_hooks(self) -> None:
        self._placements = {}
        self._register_load_state_dict_pre_hook(self._load_hook, with_module=False)
        self._register_state_dict_hook(self._save_hook)

    @staticmethod
    def local(p: torch.Tensor | None) -> torch.Tensor | None:
        """The local shard of a parameter, differentiably (its gradient flows back as a DTensor)."""
        if p is None or not is_dtensor(p):
            return p
        if torch.compiler.is_compiling():
            return p.to_local()  # dynamo knows to_local; it does not trace our Function's spec handling
        return _LocalShard.apply(p)

    def local_data(self, name: str) -> torch.Tensor:
        """The local shard of parameter `name` without autograd, for in-place init and copies."""
        p = getattr(self, name)
        return p._local_tensor if is_dtensor(p) else p.data

    def _as_dtensor(self, name: str, local: torch.Tensor):
        shape = torch.Size(self._global_shape(name))
        DTensor, _, _ = _dtensor()
        return DTensor.from_local(local, self.mesh, self._placements[name], run_check=False, shape=shape,
                                  stride=torch.empty(shape, device="meta").stride())

    def _save_hook(self, module, state_dict, prefix, local_metadata):
        # Plain local shards (after localize_parameters) go out as DTensors, sharing storage.
        if self.mesh is None:
            return
        for name in self._placements:
            key = prefix + name
            if key in state_dict and not is_dtensor(state_dict[key]):
                state_dict[key] = self._as_dtensor(name, state_dict[key])

    def _load_hook(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        label = getattr(self, "name", "") or type(self).__name__
        for name in self._placements:
            key = prefix + name
            if key not in state_dict or getattr(self, name) is None:
                continue
            value, param = state_dict[key], getattr(self, name)
            shape = tuple(self._global_shape(name))
            if is_dtensor(value):
                if is_dtensor(param) and value.device_mesh == param.device_mesh and \
                        tuple(value.placements) == tuple(param.placements):
                    continue  # the parameter's own layout (FSDP2's 2-D on top): nn.Module copies it
                if self.mesh is None or value.device_mesh != self.mesh:
                    raise ValueError(f"{label}: state_dict[{key!r}] is a DTensor on {value.device_mesh}; this "
                                     f"layer's parameters live on {self.mesh}")
                if tuple(value.placements) != tuple(self._placements[name]):
                    value = value.redistribute(self.mesh, self._placements[name])
                local = value.to_local()
            else:
                if tuple(value.shape) != shape:
                    raise ValueError(f"{label}: state_dict[{key!r}] has shape {tuple(value.shape)}; a plain tensor "
                                     f"must be the full (unsharded) parameter of shape {shape}")
                local = self.shard_of(value)
            state_dict[key] = local if not is_dtensor(param) else self._as_dtensor(name, local)

    def localize_parameters(self, done: dict | None = None) -> None:
        """Replace DTensor parameters by plain Parameters of their local shards (same storage).

        For engines that flatten parameters into buffers (overlapkit's ShardedOptimizer): this
        layer computes on local shards anyway, and `state_dict()` still wraps them as DTensors.
        `done` (id of a DTensor parameter -> its plain one) keeps a parameter tied to another
        layer's one parameter.
        """
        done = {} if done is None else done
        for name in self._placements:
            p = getattr(self, name)
            if p is not None and is_dtensor(p):
                if id(p) not in done:
                    done[id(p)] = nn.Parameter(p._local_tensor, requires_grad=p.requires_grad)
                setattr(self, name, done[id(p)])

    def _global_shape(self, name: str) -> Sequence[int]:
        raise NotImplementedError


def is_parallelized(module: nn.Module) -> bool:
    """Whether `module` holds tensor-parallel layers or DTensor parameters: what `parallelize` leaves at
    any TP size (at TP size 1 its parameters are plain, its layers still overlapkit's)."""
    return any(isinstance(m, LocalShardParams) for m in module.modules()) or \
        any(is_dtensor(p) for p in module.parameters())


def localize_parameters(module: nn.Module) -> nn.Module:
    """Plain local tensors for every DTensor parameter: `localize_parameters()` on the submodules
    that compute on local shards, plain Parameters of the local tensor for replicated DTensor
    parameters elsewhere (norms; their modules compute on local views anyway). Tied parameters
    stay one. Returns `module`."""
    done: dict[int, nn.Parameter] = {}
    for m in module.modules():
        if isinstance(m, LocalShardParams):
            m.localize_parameters(done)
            continue
        for name, p in list(m._parameters.items()):
            if p is not None and is_dtensor(p):
                if id(p) not in done:
                    done[id(p)] = nn.Parameter(p._local_tensor, requires_grad=p.requires_grad)
                m._parameters[name] = done[id(p)]
    return module
