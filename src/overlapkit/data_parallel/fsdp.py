"""ZeRO-3 with torch's FSDP2 underneath: each block's parameter all-gather is prefetched `depth` blocks
ahead, so it overlaps the forward of the blocks before it; in backward the next block's gather
overlaps the current block's backward and its gradient reduce-scatter.

`fully_shard` wraps the blocks with torch's `fully_shard` (no FSDP of our own) and sets FSDP2's
explicit prefetch lists to the depth asked, or under `prefetch="auto"` to the depth the cost model
picks from a probe step and a few timed trials (fsdp_prefetch.py). Its collectives go through
`runtime.comm` (fsdp_comm.py), so the timeline sees them. docs/data_parallel.md has the details.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from ..runtime.agreement import agree
from ..runtime.deprecation import deprecated
from ..tensor_parallel.replicated import SUMMED_BY_HOOK
from ..vocabulary import OVERLAP_MEANING, check_prefetch, is_int_at_least, positive_int
from .agree import copy_from_first_rank
from .fsdp_check import ADVICE, StepCheck
from .progress import Progress
from .fsdp_prefetch import MIB, ZeroThree
from .watch import ParamWatch


@dataclass(frozen=True)
class FullyShardConfig:
    """How ZeRO-3 prefetches."""

    prefetch: int | tuple[int, int] | str = "auto"
    """Blocks whose gathers are issued ahead of use, in forward and in backward: an int >= 0, a
    (forward, backward) pair of them (what auto may choose, pinned), or "auto" (measured on the
    second step, then priced by the cost model; the first two steps run at depth 0)."""
    reshard_after_forward: bool = True
    """Free each block's gathered parameters after its forward (ZeRO-3: gathered again in
    backward); False keeps them to backward (ZeRO-2-like memory, no backward gathers)."""
    memory_budget_mb: float | None = None
    """Unsharded parameter MiB that `auto` may hold in prefetched blocks beyond the block in use;
    None: bounded only by max_depth."""
    max_depth: int = 4
    """Deepest prefetch `auto` considers. Each level holds one more block's parameters."""
    probe_step: int = 1
    """The step `auto` measures (0-based; the steps before it warm up caches and connections)."""
    trials: int = 0
    """Rounds (after one untimed one) in which `auto` times the model's pick against the neighbouring
    depths the model prices within 10 % of it, one step each; a neighbour displaces the pick only if
    faster in at least three rounds in four (and by > 1 % in the median ratio); 0 (the default) keeps
    the pick of the probe and the cost model. Off by default because measured at 8 gloo ranks, a model
    that ran trials stayed 1.08-1.12x slower than a fixed model at the same depths afterwards, while
    auto without them matched its twin (benchmarks/results/fsdp_overlap_cpu16_ws8.md); the cause is
    not found."""

    def __post_init__(self) -> None:
        check_prefetch(self.prefetch, "fully_shard prefetch", pairs=True)
        if not isinstance(self.reshard_after_forward, bool):
            raise ValueError(f"fully_shard reshard_after_forward must be True or False, got {self.reshard_after_forward!r}")
        b = self.memory_budget_mb
        if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 <= b < math.inf):
            raise ValueError(f"fully_shard memory_budget_mb must be None or a finite number of MiB >= 0, got {b!r}")
        for name, lo in (("max_depth", 1), ("probe_step", 0), ("trials", 0)):
            positive_int(getattr(self, name), f"fully_shard {name}", minimum=lo)


@dataclass
class PrefetchPlan:
    """What `fully_shard` set up, and (for auto) what it measured and why it chose its depths."""

    units: list[str]
    """The blocks wrapped as FSDP2 units, in the order they are prefetched."""
    unit_param_bytes: list[int]
    """Unsharded parameter bytes of each block (what one gather brings in)."""
    mode: str
    """"fixed" or "auto"."""
    forward_depth: int
    backward_depth: int
    decided: bool
    """False while auto is still measuring (depth 0 meanwhile)."""
    reason: str
    memory_budget_bytes: float | None
    probe: dict = field(default_factory=dict)
    """auto's measured times (ms, slowest rank): per-block compute, gather and reduce-scatter."""
    measured: dict = field(default_factory=dict)
    """auto's trials: "forward/backward" depths -> median step ms (slowest rank) over the rounds."""

    def held_ahead_bytes(self, depth: int) -> int:
        """Most unsharded bytes held in prefetched blocks beyond the one in use at `depth`."""
        b = self.unit_param_bytes
        return max((sum(b[i + 1:i + 1 + depth]) for i in range(len(b))), default=0) if depth else 0

    @property
    def prefetch_bytes(self) -> int:
        return self.held_ahead_bytes(max(self.forward_depth, self.backward_depth))


def fully_shard(model: nn.Module, mesh_or_dim=None, *, dim: str = "dp", overlap: str = "auto",
                prefetch_depth: int | tuple[int, int] | None = None, wrap=None, reshard_after_forward: bool = True,
                memory_budget_mb: float | None = None, max_depth: int = 4, trials: int = 0,
                mp_policy=None, prefetch: int | tuple[int, int] | str | None = None) -> nn.Module:
    """Shard `model` over the data-parallel mesh dim with FSDP2 and set its prefetch; returns `model`.

    mesh_or_dim: a 1-D DeviceMesh, a DeviceMesh with a `dim` dim (e.g. ("dp", "tp") with TP
    DTensor parameters on "tp"), a ParallelGroups, a ProcessGroup, or None (the world).
    wrap: the blocks, each one FSDP2 unit: None (the entries of the model's longest ModuleList or
    ModuleDict, e.g. a pipeline chunk's blocks, else its direct children with parameters), a module
    name (a ModuleList's or ModuleDict's name means its entries), a list of names, or a module class
    (or tuple of classes).
    Collective: every rank calls it with the same arguments; anything that differs, or a bad
    argument, raises on every rank. Parameters and buffers start as group rank 0's.
    overlap: "auto" (the prefetch depth from a probe step and the cost model), "bulk" (each block's
    gathers issued `prefetch_depth` blocks ahead: an int >= 1, default 1, or a (forward, backward) pair
    of depths, which pins what auto chose, so that a fixed model issues exactly the gathers, in the
    same order, as the auto one) or "none" (each block gathered when it runs).
    `prefetch_plan(model)` says what was chosen, and why. `prefetch=` ("auto" or depths) is the
    earlier spelling of both (a DeprecationWarning once).
    """
    mesh = _dp_mesh(mesh_or_dim, dim)
    group = mesh.get_group()
    experts = [n for n, p in model.named_parameters() if getattr(p, "expert_parallel", False)]
    if experts and mesh.size() > 1:
        # Each EP rank holds other experts: copying rank 0's and averaging over dp would mix them, silently.
        raise ValueError(f"fully_shard: {len(experts)} parameter(s) are expert-parallel (e.g. {experts[0]!r}), held "
                         "by one rank of each EP group, which fully_shard over dp cannot shard yet; wrap the model "
                         "in DataParallel(model, groups.dp), which reduces each expert over its copies only")
    _rehome_dtensors(model, mesh_or_dim)
    problem = None
    try:
        prefetch = _prefetch_of(overlap, prefetch_depth, prefetch)
        cfg = FullyShardConfig(prefetch=prefetch, reshard_after_forward=reshard_after_forward,
                               memory_budget_mb=memory_budget_mb, max_depth=max_depth, trials=trials)
        units = _resolve_wrap(model, wrap)
    except (ValueError, TypeError) as e:
        problem, cfg, units = str(e), None, []
    if any(hasattr(m, "_overlapkit_zero3") for m in model.modules()):
        problem = problem or "fully_shard: this model (or a module inside it) is already sharded by fully_shard"
    tensors = [(n, p.to_local() if isinstance(p, DTensor) else p) for n, p in model.named_parameters()]
    # requires_grad too: FSDP2 reduce-scatters only the gradients of parameters that require one,
    # so a parameter frozen on one rank makes that rank's reduce-scatters smaller than the others'.
    layout = ";".join(f"{n}:{tuple(t.shape)}:{t.dtype}:{'grad' if p.requires_grad else 'frozen'}"
                      for (n, t), p in zip(tensors, model.parameters()))
    # Ranks that shard differently would pair unrelated gathers: compare before any FSDP2 state exists.
    agree(group, "fully_shard", problem=problem, prefetch=prefetch, reshard_after_forward=reshard_after_forward,
          memory_budget_mb=memory_budget_mb, max_depth=max_depth, trials=trials, units=[n for n, _ in units],
          parameters=len(tensors), layout_crc=zlib.crc32(layout.encode()))
    if problem is not None:
        raise ValueError(problem)
    with torch.no_grad():
        copy_from_first_rank([t for _, t in tensors] + list(model.buffers()), group)
    unit_bytes = [sum(_local(p).numel() * _local(p).element_size() for p in m.parameters()) for _, m in units]
    kw = {} if mp_policy is None else {"mp_policy": mp_policy}
    for _, m in units:
        torch_fully_shard(m, mesh=mesh, reshard_after_forward=cfg.reshard_after_forward, **kw)
    torch_fully_shard(model, mesh=mesh, **kw)
    auto = cfg.prefetch == "auto"
    fd, bd = (0, 0) if auto else cfg.prefetch if isinstance(cfg.prefetch, tuple) else (cfg.prefetch, cfg.prefetch)
    plan = PrefetchPlan(units=[n for n, _ in units], unit_param_bytes=unit_bytes, mode="auto" if auto else "fixed",
                        forward_depth=fd, backward_depth=bd, decided=not auto,
                        reason="measuring (depth 0 until the probe step)" if auto else f"asked for {fd}/{bd}",
                        memory_budget_bytes=None if cfg.memory_budget_mb is None else cfg.memory_budget_mb * MIB)
    check = StepCheck(ParamWatch(model, "fully_shard", ADVICE), [n for n, _ in units], group)
    model._overlapkit_zero3 = ZeroThree(model, [m for _, m in units], [n for n, _ in units], plan, group,
                                        mesh.device_type, cfg, check)
    # Before FSDP2's own pre-forward gathers (prepend): a rank that skipped backward() or step() is
    # named here instead of pairing its next gather with the others' reduce-scatter.
    progress = Progress(list(model.parameters()), group, "fully_shard", replicas=False)
    model._overlapkit_progress = progress
    model.register_forward_pre_hook(lambda m, _args: progress.before_forward(m.training), prepend=True)
    return model


def _prefetch_of(overlap, prefetch_depth, prefetch):
    """The depth setting ("auto", a depth or a pair) that `overlap` and `prefetch_depth` name, or the old `prefetch`."""
    if prefetch is not None:
        deprecated("fully_shard(prefetch=...)", 'fully_shard(overlap="auto" | "bulk" | "none", prefetch_depth=...)')
        if overlap != "auto" or prefetch_depth is not None:
            raise ValueError(f"fully_shard: prefetch={prefetch!r} is the earlier spelling of overlap= and "
                             f"prefetch_depth=; pass one or the other (got overlap={overlap!r}, "
                             f"prefetch_depth={prefetch_depth!r})")
        return prefetch
    if overlap not in OVERLAP_MEANING["zero"]:
        raise ValueError(f"fully_shard overlap={overlap!r} is not one of {tuple(OVERLAP_MEANING['zero'])}")
    if overlap == "bulk":
        depth = 1 if prefetch_depth is None else prefetch_depth
        if not isinstance(depth, tuple) and not is_int_at_least(depth, 1):  # a pair: FullyShardConfig checks it
            raise ValueError(f"fully_shard prefetch_depth={prefetch_depth!r} must be an integer >= 1 (blocks ahead) "
                             "or a (forward, backward) pair of depths under overlap='bulk'")
        return depth
    if prefetch_depth is not None:
        raise ValueError(f"fully_shard prefetch_depth={prefetch_depth!r} is for overlap='bulk'; overlap={overlap!r} "
                         "sets its own depth")
    return "auto" if overlap == "auto" else 0


def prefetch_plan(model: nn.Module) -> PrefetchPlan:
    """The prefetch `fully_shard` set on `model` (for auto: measured times and the reason, once decided)."""
    state = getattr(model, "_overlapkit_zero3", None)
    if state is None:
        raise ValueError("prefetch_plan: this model was not sharded by overlapkit.data_parallel.fully_shard")
    return state.plan


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _rehome_dtensors(model: nn.Module, mesh_or_dim) -> None:
    """Put DTensor parameters that live on an unnamed 1-D mesh onto the same ranks' dim of the root mesh.

    FSDP2 composes with TP only when the TP DTensors' mesh is a named dim of the mesh whose
    "dp" dim it shards over; TP layers built from a ProcessGroup get a free-standing 1-D mesh.
    Same ranks, same local tensor, same placements: only the mesh object changes.
    """
    from ..runtime.groups import ParallelGroups

    root = mesh_or_dim.mesh if isinstance(mesh_or_dim, ParallelGroups) else mesh_or_dim
    names = tuple(getattr(root, "mesh_dim_names", None) or ())
    if getattr(root, "ndim", 1) < 2 or not names:
        return
    by_ranks = {tuple(dist.get_process_group_ranks(root.get_group(n))): n for n in names}
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for pname, p in list(module.named_parameters(recurse=False)):
            if id(p) in done:
                setattr(module, pname, done[id(p)])  # a tied parameter stays tied
                continue
            if not isinstance(p, DTensor) or p.device_mesh.ndim != 1 or p.device_mesh.mesh_dim_names:
                continue
            dim_name = by_ranks.get(tuple(dist.get_process_group_ranks(p.device_mesh.get_group())))
            if dim_name is None:
                continue
            new = nn.Parameter(DTensor.from_local(p.to_local(), root[dim_name], p.placements, run_check=False,
                                                  shape=p.shape, stride=p.stride()), requires_grad=p.requires_grad)
            new.__dict__.update(p.__dict__)  # markers such as `sequence_parallel`
            new.__dict__.pop(SUMMED_BY_HOOK, None)  # the gradient hook stays on `p`: the view sums instead
            done[id(p)] = new
            setattr(module, pname, new)


def _dp_mesh(mesh_or_dim, dim: str):
    """The 1-D DeviceMesh FSDP2 shards over."""
    from torch.distributed.device_mesh import DeviceMesh

    from ..runtime.groups import ParallelGroups, default_device_type

    if isinstance(mesh_or_dim, ParallelGroups):
        if mesh_or_dim.mesh is None:
            raise ValueError("fully_shard: this ParallelGroups has no DeviceMesh (a world of one without dist)")
        mesh_or_dim = mesh_or_dim.mesh
    if mesh_or_dim is None or isinstance(mesh_or_dim, dist.ProcessGroup):
        if not dist.is_initialized():
            raise RuntimeError("fully_shard needs torch.distributed initialized (overlapkit.init() or init_process_group)")
        return DeviceMesh.from_group(mesh_or_dim or dist.group.WORLD, default_device_type())
    if isinstance(mesh_or_dim, DeviceMesh):
        names = tuple(mesh_or_dim.mesh_dim_names or ())
        if mesh_or_dim.ndim == 1:
            return mesh_or_dim
        if dim not in names:
            raise ValueError(f"fully_shard: the DeviceMesh has dims {names or '(unnamed)'}; pass dim= one of them "
                             f"(the data-parallel one), got dim={dim!r}")
        return mesh_or_dim[dim]
    raise TypeError("fully_shard: mesh_or_dim must be a DeviceMesh, a ParallelGroups, a ProcessGroup or None, "
                    f"got {type(mesh_or_dim).__name__}")


def _resolve_wrap(model: nn.Module, wrap) -> list[tuple[str, nn.Module]]:
    """(name, module) of each block to wrap, in registration order."""
    named = dict(model.named_modules())
    if wrap is None:
        lists = [(n, m) for n, m in named.items() if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m)]
        if lists:
            name, blocks = max(lists, key=lambda nm: len(nm[1]))
            return _entries(name, blocks)
        return [(n, m) for n, m in model.named_children() if any(True for _ in m.parameters())]
    if isinstance(wrap, type) or (isinstance(wrap, tuple) and wrap and all(isinstance(t, type) for t in wrap)):
        out: list[tuple[str, nn.Module]] = []
        for n, m in named.items():
            if n and isinstance(m, wrap) and not any(n.startswith(o + ".") for o, _ in out):
                out.append((n, m))
        if not out:
            raise ValueError(f"fully_shard wrap={wrap!r} matches no module of {type(model).__name__}")
        return out
    names = [wrap] if isinstance(wrap, str) else wrap
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"fully_shard wrap must be None, a module name, a list of names or a module class, got {wrap!r}")
    missing = [n for n in names if n not in named or n == ""]
    if missing:
        top = [n for n in named if n and "." not in n]
        raise ValueError(f"fully_shard wrap names no module: {missing}; {type(model).__name__} has {top[:12]}"
                         f"{' ...' if len(top) > 12 else ''} (nested names use dots, e.g. 'blocks.0')")
    out = []
    for n in names:
        m = named[n]
        out += _entries(n, m) if isinstance(m, (nn.ModuleList, nn.Sequential, nn.ModuleDict)) else [(n, m)]
    return out


def _entries(name: str, container: nn.Module) -> list[tuple[str, nn.Module]]:
    """(fqn, module) of a ModuleList's, Sequential's or ModuleDict's entries, in order."""
    return [(f"{name}.{key}" if name else key, m) for key, m in container.named_children()]
