"""The DeviceMesh of a job (named dims pp, dp, cp, tp) and `ParallelGroups`, a view of it.

Nothing here overlaps anything: it lays the world out so that the engines know which ranks
they talk to. The mesh is row-major over (pp, dp, cp, tp), so tensor-parallel ranks are
adjacent (rank = tp + tp_size * (cp + cp_size * (dp + dp_size * pp))), as in Megatron and
torchtitan: the chattiest group stays inside a node where NVLink is. Expert-parallel groups
are carved out of the data-parallel group (adjacent DP ranks).

Every group is created here with the job's timeout (torch's `new_group` and
`init_device_mesh` would otherwise give each group torch's 30-minute default, whatever the
user asked for). No module globals: every engine takes its mesh dim or group as an argument,
and `resolve_group` turns whatever the user passes into the ProcessGroup an engine needs.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..vocabulary import DIMS, Coords, ParallelSizes  # noqa: F401 (re-exported)
from . import state
from .agreement import agree
from .timeouts import DEFAULT_TIMEOUT_S, check_timeout, group_timeout_s, world_timeout_s  # noqa: F401 (re-exported)

@dataclass(frozen=True)
class ParallelGroups:
    """This rank's mesh, process groups and coordinates. Build with `ParallelGroups.build` or `init`.

    `mesh` is the job's DeviceMesh with dims ("pp", "dp", "cp", "tp"); `tp`, `dp`, `pp`, `cp`
    are its groups (`groups.tp is groups.mesh["tp"].get_group()`), `ep` the expert group
    carved from dp.
    """

    sizes: ParallelSizes
    """The layout the groups were built from."""
    rank: int
    """Global rank of this process."""
    tp: dist.ProcessGroup | None = field(repr=False)
    """Tensor-parallel group of this rank (None only in a world of one process without dist)."""
    dp: dist.ProcessGroup | None = field(repr=False)
    """Data-parallel group of this rank."""
    pp: dist.ProcessGroup | None = field(repr=False)
    """Pipeline-parallel group of this rank."""
    ep: dist.ProcessGroup | None = field(repr=False)
    """Expert-parallel group of this rank."""
    cp: dist.ProcessGroup | None = field(default=None, repr=False)
    """Context-parallel group of this rank."""
    mesh: Any = field(default=None, repr=False)
    """The DeviceMesh over (pp, dp, cp, tp) these groups are the dims of."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Timeout every group here was created with (seconds)."""

    @property
    def coords(self) -> Coords:
        if self.mesh is None:
            return self.sizes.coords(self.rank)
        # Read from the mesh: a user's mesh may order its dims differently from ours.
        names = tuple(self.mesh.mesh_dim_names)
        return Coords(**{d: self.mesh.get_local_rank(d) if d in names else 0 for d in DIMS})

    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    @property
    def cp_rank(self) -> int:
        return self.coords.cp

    def group(self, dim: str) -> dist.ProcessGroup:
        """The group of one dim by name ("tp", "dp", "pp", "cp", "ep")."""
        if dim not in (*DIMS, "ep"):
            raise ValueError(f"unknown parallel dim {dim!r}; expected one of {(*DIMS, 'ep')}")
        return getattr(self, dim)

    @classmethod
    def build(cls, tp: int = 1, dp: int | None = None, pp: int = 1, ep: int = 1, cp: int = 1, *,
              timeout_s: float | None = None, device_type: str | None = None) -> "ParallelGroups":
        """Build the mesh and every group from the already initialized default process group.

        Collective: every rank must call it with the same sizes. `dp=None` takes what is left
        of the world after tp, cp and pp. `timeout_s=None` gives every group the world's
        timeout (what `init_process_group` / `init(timeout_s=)` / `launch.spawn` set).
        """
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call overlapkit.init() or init_process_group first")
        world = dist.get_world_size()
        problem, sizes = None, None
        try:
            timeout_s = world_timeout_s() if timeout_s is None else check_timeout(timeout_s)
            sizes = _sizes_for(world, tp=tp, dp=dp, pp=pp, ep=ep, cp=cp)
        except ValueError as e:
            problem = str(e)
        # Ranks that lay the world out differently would each wait in new_group for groups the
        # others never create (a store timeout per group): compare the sizes first, on the store.
        agree(dist.group.WORLD, "ParallelGroups.build", timeout_s=timeout_s if problem is None else None,
              problem=problem, tp=tp, dp=dp, pp=pp, ep=ep, cp=cp)
        if problem is not None:
            raise ValueError(problem)
        timeout = datetime.timedelta(seconds=timeout_s)
        rank = dist.get_rank()
        mine = {}
        # Every rank must create every group, in the same order, even those it is not in.
        for name in (*DIMS, "ep"):
            layout = sizes.ep_groups() if name == "ep" else sizes.groups_of(name)
            for ranks in layout:
                group = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    mine[name] = group
        from torch.distributed.device_mesh import DeviceMesh

        device_type = device_type or default_device_type()
        layout = torch.arange(sizes.world_size).reshape(sizes.shape)
        mesh = DeviceMesh.from_group([mine[d] for d in DIMS], device_type, mesh=layout, mesh_dim_names=DIMS)
        _remember_expert_group(mesh, mine["ep"], ep)
        _make_expert_data_groups(mine["ep"], sizes.dp_groups(), ep, timeout)
        return cls(sizes=sizes, rank=rank, mesh=mesh, timeout_s=timeout_s, **mine)

    @classmethod
    def from_mesh(cls, mesh, ep: int = 1, *, timeout_s: float | None = None) -> "ParallelGroups":
        """A view of a user's DeviceMesh. Dims it lacks (of pp, dp, cp, tp) count as size 1.

        Collective when ep > 1 (the expert groups are created then, with the world's timeout).
        """
        names = tuple(mesh.mesh_dim_names or ())
        unknown = [n for n in names if n not in DIMS]
        if not names or unknown:
            raise ValueError(f"the DeviceMesh needs named dims among {DIMS}; it has {names or 'no names'}")
        problem = None
        try:
            sizes = ParallelSizes(ep=ep, **{n: mesh.size(names.index(n)) for n in names})
            if mesh.size() != dist.get_world_size():
                raise ValueError(f"the DeviceMesh spans {mesh.size()} ranks but the world has {dist.get_world_size()}")
        except ValueError as e:
            problem = str(e)
        if ep > 1:  # the expert groups are created below: every rank must carve the same ones
            agree(dist.group.WORLD, "ParallelGroups.from_mesh", problem=problem, ep=ep, dims=names,
                  shape=tuple(mesh.shape))
        if problem is not None:
            raise ValueError(problem)
        mine = {n: mesh.get_group(n) for n in names}
        for n in DIMS:
            mine.setdefault(n, None)  # a dim the mesh lacks has size 1: no group to talk over
        timeout_s = world_timeout_s() if timeout_s is None else check_timeout(timeout_s)
        rank = dist.get_rank()
        mine["ep"] = mine["dp"] if ep == sizes.dp else None
        if mine["ep"] is None:
            timeout = datetime.timedelta(seconds=timeout_s)
            # ep carved from dp: the dp groups of the user's mesh, split into ep-sized runs.
            for dp_ranks in _all_groups_along(mesh, "dp", names):
                for i in range(0, len(dp_ranks), ep):
                    group = dist.new_group(dp_ranks[i:i + ep], timeout=timeout)
                    if rank in dp_ranks[i:i + ep]:
                        mine["ep"] = group
        _remember_expert_group(mesh, mine["ep"], ep)
        _make_expert_data_groups(mine["ep"], _all_groups_along(mesh, "dp", names), ep,
                                 datetime.timedelta(seconds=timeout_s))
        return cls(sizes=sizes, rank=rank, mesh=mesh, timeout_s=timeout_s, **mine)


_EXPERT_GROUPS: dict = state.process_dict("groups.expert_group_of_mesh")
"""id(mesh) -> (mesh, its expert-parallel group, ep): the mesh has dims (pp, dp, cp, tp) only, so
`parallelize(model, groups.mesh)` finds the ep that `init` carved out of dp here. Process wiring, not a
cache: `state.reset()` forgetting it would leave a later `parallelize` on the same mesh with its experts
whole on every rank, silently."""


def _remember_expert_group(mesh, group, ep: int) -> None:
    _EXPERT_GROUPS[id(mesh)] = (mesh, group, ep)


_EXPERT_DATA: dict = state.process_dict("groups.expert_data_group_of")
"""id(expert-parallel group) -> (that group, the group of the ranks holding copies of the same experts or
None where each expert has one copy in its dp group): how DataParallel reduces each expert's gradient over
its copies and no more."""


def _make_expert_data_groups(ep_group, dp_layouts: list[list[int]], ep: int, timeout) -> None:
    # The copies of the experts at EP position k of a dp group are its ranks k, k + ep, k + 2ep, ...
    # (the EP groups are its consecutive runs of ep). Every rank creates every group, in one order.
    if ep == 1 or ep_group is None:
        return
    rank, mine = dist.get_rank(), None
    for dp_ranks in dp_layouts:
        if len(dp_ranks) == ep:
            continue  # one copy of each expert per dp group: nothing to reduce over
        for k in range(ep):
            group = dist.new_group(dp_ranks[k::ep], timeout=timeout)
            if rank in dp_ranks[k::ep]:
                mine = group
    _EXPERT_DATA[id(ep_group)] = (ep_group, mine)


def expert_data_group_of(ep_group) -> tuple[bool, dist.ProcessGroup | None]:
    """(whether `overlapkit.init` built this expert-parallel group, the group of the ranks that hold copies of
    this rank's experts: None where each expert has a single copy in the data-parallel group)."""
    entry = _EXPERT_DATA.get(id(ep_group))
    if entry is None or entry[0] is not ep_group:
        return False, None
    return True, entry[1]


def expert_group_of(mesh) -> tuple[dist.ProcessGroup | None, int]:
    """(the expert-parallel group, ep) that `init` / `ParallelGroups` built with this DeviceMesh, or
    a ParallelGroups' own; (None, 1) for a mesh built elsewhere (no experts split)."""
    if isinstance(mesh, ParallelGroups):
        return mesh.ep, mesh.sizes.ep
    entry = _EXPERT_GROUPS.get(id(mesh))
    if entry is None or entry[0] is not mesh:
        return None, 1
    return entry[1], entry[2]


def _sizes_for(world: int, *, tp: int, dp: int | None, pp: int, ep: int, cp: int) -> ParallelSizes:
    """The layout `build` asked for on a world of `world` ranks (`dp=None`: what is left); ValueError if it does not fit."""
    if dp is None:
        ParallelSizes(tp=tp, pp=pp, cp=cp)  # each an integer >= 1, or its name in the error
        if world % (tp * pp * cp) != 0:
            raise ValueError(f"tp={tp} x cp={cp} x pp={pp} = {tp * cp * pp} does not divide the world size {world}")
        dp = world // (tp * pp * cp)
    sizes = ParallelSizes(tp=tp, dp=dp, pp=pp, ep=ep, cp=cp)
    sizes.check_world(world)
    return sizes


def _all_groups_along(mesh, dim: str, names: tuple[str, ...]) -> list[list[int]]:
    axis = names.index(dim)
    t = mesh.mesh.movedim(axis, -1)
    return t.reshape(-1, t.shape[-1]).tolist()


def default_device_type() -> str:
    pg = dist.distributed_c10d._get_default_group()
    return "cuda" if torch.device("cuda") in getattr(pg, "_device_types", ()) and \
        dist.get_backend() == "nccl" else "cpu"


def resolve_group(mesh_or_group, dim: str | None = None) -> dist.ProcessGroup | None:
    """The ProcessGroup an engine talks over, from whatever the user passed.

    Accepts a ProcessGroup (returned as is), a 1-D DeviceMesh, a DeviceMesh and the name of
    one of its dims, a ParallelGroups and a dim name, or None — which, as everywhere in
    torch.distributed, means the default (world) group, or no group at all when
    torch.distributed is not initialized (one process).
    """
    from torch.distributed.device_mesh import DeviceMesh

    if mesh_or_group is None:
        return dist.group.WORLD if dist.is_initialized() else None
    if isinstance(mesh_or_group, dist.ProcessGroup):
        return mesh_or_group
    if isinstance(mesh_or_group, ParallelGroups):
        if dim is None:
            raise ValueError("a ParallelGroups needs the dim to use, e.g. resolve_group(groups, 'tp')")
        return mesh_or_group.group(dim)
    if isinstance(mesh_or_group, DeviceMesh):
        names = tuple(mesh_or_group.mesh_dim_names or ())
        if mesh_or_group.ndim == 1 and (dim is None or names in ((), (dim,))):
            return mesh_or_group.get_group()
        if dim is None or dim not in names:
            raise ValueError(f"the DeviceMesh has dims {names or '(unnamed)'}; this needs a {dim or 'named'!r} dim "
                             f"(pass mesh[{dim or 'dim'!r}] or a mesh with that dim)")
        return mesh_or_group.get_group(dim)
    raise TypeError(f"expected a ProcessGroup, a DeviceMesh or a ParallelGroups, got {type(mesh_or_group).__name__}")


def default_backend(device: str | None = None) -> str:
    """NCCL when this process drives a CUDA device, gloo otherwise."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return "nccl" if device.startswith("cuda") else "gloo"


def init(tp: int = 1, dp: int | None = None, pp: int = 1, ep: int = 1, cp: int = 1, *,
         mesh=None, backend: str | None = None, timeout_s: float | None = None) -> ParallelGroups:
    """Initialize torch.distributed from the torchrun environment (if not done) and build the mesh.

    Under torchrun, RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT are read; with CUDA the
    process binds to cuda:LOCAL_RANK. An already initialized default group is used as it is.
    Pass `mesh=` (a DeviceMesh with named dims among pp, dp, cp, tp) to use yours instead.
    Every group gets `timeout_s`; None: the world's timeout when the world is already initialized
    (what `init_process_group(timeout=)` set), else DEFAULT_TIMEOUT_S for the world and every group.
    """
    if timeout_s is not None:
        timeout_s = check_timeout(timeout_s)
    if not dist.is_initialized():
        backend = backend or default_backend()
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        world_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=world_s))
    if mesh is not None:
        return ParallelGroups.from_mesh(mesh, ep=ep, timeout_s=timeout_s)
    return ParallelGroups.build(tp=tp, dp=dp, pp=pp, ep=ep, cp=cp, timeout_s=timeout_s)
