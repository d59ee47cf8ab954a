"""Process groups for tensor, data, pipeline and expert parallelism, as one explicit object.

Nothing here overlaps anything: it lays the world out so that the engines know which ranks
they talk to. Tensor-parallel ranks are adjacent (rank = tp + tp_size * (dp + dp_size * pp)),
as in Megatron, so that the chattiest group stays inside a node where NVLink is.
Expert-parallel groups are carved out of the data-parallel group (adjacent DP ranks).

No module globals: every engine takes the group it uses as an argument.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelSizes:
    """The sizes of each parallel dimension; their product (without ep) is the world size."""

    tp: int = 1
    """Tensor-parallel size: ranks that split every GEMM of a layer. Adjacent ranks."""
    dp: int = 1
    """Data-parallel size: ranks that hold the same parameters and split the batch."""
    pp: int = 1
    """Pipeline-parallel size: ranks that hold consecutive stages of layers."""
    ep: int = 1
    """Expert-parallel size: carved out of dp (must divide it), like Megatron's expert DP."""

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "pp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelSizes.{name} must be an integer >= 1, got {value!r}")
        if self.dp % self.ep != 0:
            raise ValueError(
                f"ParallelSizes.ep={self.ep} must divide dp={self.dp}: expert-parallel groups "
                "are carved out of the data-parallel group"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.pp

    def check_world(self, world_size: int) -> None:
        if self.world_size != world_size:
            raise ValueError(
                f"tp={self.tp} x dp={self.dp} x pp={self.pp} = {self.world_size} "
                f"does not equal the world size {world_size}"
            )

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, dp_rank, pp_rank) of a global rank."""
        return rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp)

    def rank_of(self, tp: int, dp: int, pp: int) -> int:
        return tp + self.tp * (dp + self.dp * pp)

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank_of(t, d, p) for t in range(self.tp)] for p in range(self.pp) for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank_of(t, d, p) for d in range(self.dp)] for p in range(self.pp) for t in range(self.tp)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank_of(t, d, p) for p in range(self.pp)] for d in range(self.dp) for t in range(self.tp)]

    def ep_groups(self) -> list[list[int]]:
        out = []
        for ranks in self.dp_groups():
            out += [ranks[i : i + self.ep] for i in range(0, len(ranks), self.ep)]
        return out


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's process groups and coordinates. Build with `ParallelGroups.build` or `init`."""

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

    @property
    def tp_rank(self) -> int:
        return self.sizes.coords(self.rank)[0]

    @property
    def dp_rank(self) -> int:
        return self.sizes.coords(self.rank)[1]

    @property
    def pp_rank(self) -> int:
        return self.sizes.coords(self.rank)[2]

    @classmethod
    def build(cls, tp: int = 1, dp: int | None = None, pp: int = 1, ep: int = 1) -> "ParallelGroups":
        """Build every group from the already initialized default process group.

        Collective: every rank must call it with the same sizes. `dp=None` takes what is left
        of the world after tp and pp.
        """
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call overlapkit.init() or init_process_group first")
        world = dist.get_world_size()
        if dp is None:
            if world % (tp * pp) != 0:
                raise ValueError(f"tp={tp} x pp={pp} = {tp * pp} does not divide the world size {world}")
            dp = world // (tp * pp)
        sizes = ParallelSizes(tp=tp, dp=dp, pp=pp, ep=ep)
        sizes.check_world(world)
        rank = dist.get_rank()
        mine = {}
        # Every rank must create every group, in the same order, even those it is not in.
        for name, layout in (("tp", sizes.tp_groups()), ("dp", sizes.dp_groups()),
                             ("pp", sizes.pp_groups()), ("ep", sizes.ep_groups())):
            for ranks in layout:
                group = dist.new_group(ranks)
                if rank in ranks:
                    mine[name] = group
        return cls(sizes=sizes, rank=rank, **mine)


def default_backend(device: str | None = None) -> str:
    """NCCL when this process drives a CUDA device, gloo otherwise."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return "nccl" if device.startswith("cuda") else "gloo"


def init(tp: int = 1, dp: int | None = None, pp: int = 1, ep: int = 1, *,
         backend: str | None = None, timeout_s: float = 300.0) -> ParallelGroups:
    """Initialize torch.distributed from the torchrun environment (if not done) and build the groups.

    Under torchrun, RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT are read; with CUDA the
    process binds to cuda:LOCAL_RANK. An already initialized default group is used as it is.
    """
    if not dist.is_initialized():
        backend = backend or default_backend()
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return ParallelGroups.build(tp=tp, dp=dp, pp=pp, ep=ep)
