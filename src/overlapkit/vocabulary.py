"""The words every part of overlapkit speaks, torch-free: parallel sizes, overlap modes, validators.

The engines, the cost model, the mesh (runtime.groups) and the demo all read their sizes as one
`ParallelSizes` and their overlap settings from `OVERLAP_MODES`, with the meaning per engine in
`OVERLAP_MEANING`; configs check their integers with `positive_int`. Importing this module costs
no torch import, so `overlapkit plan` stays pure arithmetic.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

OVERLAP_MODES = ("none", "bulk", "pipelined", "auto")
"""The `overlap` setting, with one meaning everywhere: none is sequential (the reference), bulk the
whole collective async beside independent compute, pipelined chunked (each chunk's compute starts
as soon as its data lands), auto the cost model's or a measurement's pick, per GEMM or per layer."""

TRANSPORTS = ("p2p", "symm_mem")
"""How pipelined TP moves its chunks: send/recv ring exchange (NCCL and gloo), or copy-engine
pulls from PyTorch symmetric memory (one node, CUDA peer access)."""

OVERLAP_MEANING: dict[str, dict[str, str]] = {
    "tp": {"none": "every collective synchronous",
           "bulk": "backward's re-gather under the dgrad GEMM, the dgrad reduce-scatter under the wgrad GEMM",
           "pipelined": "all-gather and reduce-scatter chunked into the GEMMs, forward and backward",
           "auto": "the cost model picks none, bulk or pipelined and the chunk count per GEMM"},
    "dp": {"none": "gradients all-reduced after backward",
           "bulk": "gradient buckets all-reduced during backward"},
    "zero": {"none": "each block's parameters gathered when it runs",
             "bulk": "the next blocks' parameter gathers (prefetch_depth of them) prefetched behind this block's compute",
             "auto": "the prefetch depth from the cost model, then measured"},
    "pp": {"none": "sends and receives waited at once",
           "bulk": "sends and receives beside the other micro-batch's compute"},
    "ep": {"none": "dispatch, expert GEMMs and combine one after the other",
           "pipelined": "tokens in `chunks` chunks: one chunk's all-to-all under another's expert GEMMs",
           "auto": "the chunk count measured on the first calls and kept"},
    "cp": {"none": "each key/value block received before it is attended",
           "bulk": "every key/value block sent to every rank at the start of the pass (all-gather), each "
                   "attended as it lands; backward sends each block's dK/dV part straight to its owner",
           "pipelined": "the next key/value block travels the ring while this one is attended",
           "auto": "pipelined, bulk or none, measured on the first calls and kept"},
}
"""Per engine, what each overlap setting means for it (the cost model's `Overlap` accepts every mode
for every engine; an engine's own switch, ENGINE_SWITCH, takes the settings listed here)."""

ENGINE_SWITCH: dict[str, str] = {
    "tp": "ColumnParallelLinear / RowParallelLinear / parallelize(overlap=...)",
    "dp": "DataParallel(overlap=...)",
    "zero": "ShardedOptimizer(overlap=...), fully_shard(overlap=..., prefetch_depth=blocks ahead)",
    "pp": "PipelineConfig(overlap=...)",
    "ep": "MoE(overlap=..., chunks=count | 'ranks')",
    "cp": "ContextParallelConfig(overlap=..., prefetch=blocks in flight)",
}
"""Where each engine takes its overlap setting: always `overlap=` with the engine's modes of
OVERLAP_MEANING; a depth (how far ahead, how many pieces) is a field of its own beside it."""

RENAMED: dict[str, str] = {
    "PipelineConfig(overlap_p2p=True | False)": 'PipelineConfig(overlap="bulk" | "none")',
    "fully_shard(prefetch='auto' | n | (f, b))": 'fully_shard(overlap="auto" | "none" | "bulk", prefetch_depth=n | (f, b))',
    "ShardedOptimizer(overlap_param_gather=True | False)": 'ShardedOptimizer(overlap="bulk" | "none")',
    "DataParallel(overlap=True | False)": 'DataParallel(overlap="bulk" | "none")',
    "MoE(chunks='auto' | 1 | n | 'ranks')": 'MoE(overlap="auto" | "none" | "pipelined", chunks=n | "ranks")',
    "tensor_parallel.tp_mesh_and_group(x)": "tensor_parallel.tp_mesh(x) (its group: mesh.get_group())",
}
"""The earlier spellings, still accepted with a DeprecationWarning once per process, and the current ones."""


def is_int_at_least(value, minimum: int = 1) -> bool:
    """Whether `value` is a real int (not a bool) >= `minimum`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def positive_int(value, what: str, *, minimum: int = 1, error: type[Exception] = ValueError) -> int:
    """`value`, or `error` naming `what` and the value when it is not an integer >= `minimum`."""
    if not is_int_at_least(value, minimum):
        raise error(f"{what}={value!r} must be an integer >= {minimum}")
    return value


def check_bool(value, what: str, *, error: type[Exception] = ValueError) -> bool:
    """`value`, or `error` naming it unless it is True or False (a 0 or "no" must not read as a setting)."""
    if not isinstance(value, bool):
        raise error(f"{what}={value!r} must be True or False")
    return value


def check_choice(value, choices, what: str, *, error: type[Exception] = ValueError):
    """`value`, or `error` naming `what` and the choices unless it is one of them."""
    if not isinstance(value, str) or value not in choices:
        raise error(f"{what}={value!r} must be one of {', '.join(map(repr, choices))}")
    return value


def check_prefetch(value, what: str, *, pairs: bool = False, error: type[Exception] = ValueError):
    """`value`, or `error` naming `what` unless it is 'auto' or an integer >= 0 (blocks gathered ahead), or with
    `pairs` a (forward, backward) pair of such integers: the ZeRO-3 / FSDP prefetch depth, as fully_shard and
    `overlapkit plan --zero3-prefetch` take it."""
    depths = value if pairs and isinstance(value, tuple) and len(value) == 2 else (value, value)
    if value != "auto" and not all(is_int_at_least(d, 0) for d in depths):
        pair = " or a (forward, backward) pair of them" if pairs else ""
        raise error(f"{what} must be 'auto', an integer >= 0 (blocks ahead){pair}, got {value!r}")
    return value


MAX_BUCKET_MB = float(2**20)
"""Largest bucket cap accepted (1 TiB): more than any device holds, and far from the int64 byte counts overflowing."""


def check_bucket_mb(value, what: str, *, auto: bool = False, error: type[Exception] = ValueError):
    """`value`, or `error` naming `what` unless it is a finite number of MiB in (0, MAX_BUCKET_MB] (or, with
    `auto`, the word "auto"): the data-parallel bucket size, as DataParallelConfig and `overlapkit plan
    --bucket-mb` take it."""
    if auto and value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_BUCKET_MB:
        word = '"auto" or ' if auto else ""
        raise error(f"{what} must be {word}a finite number of MiB > 0 and <= {MAX_BUCKET_MB:.0f} (1 TiB), "
                    f"got {value!r}")
    return value


DIMS = ("pp", "dp", "cp", "tp")
"""Mesh dimension names, outermost first (the order ranks are laid out in)."""


class Coords(NamedTuple):
    """Where a rank sits on each mesh dim."""

    tp: int
    dp: int
    pp: int
    cp: int = 0


@dataclass(frozen=True)
class ParallelSizes:
    """The sizes of each parallel dimension; pp * dp * cp * tp is the world size (ep is carved from dp)."""

    tp: int = 1
    """Tensor-parallel size: ranks that split every GEMM of a layer. Adjacent ranks."""
    dp: int = 1
    """Data-parallel size: ranks that hold the same parameters and split the batch."""
    pp: int = 1
    """Pipeline-parallel size: ranks that hold consecutive stages of layers."""
    ep: int = 1
    """Expert-parallel size: carved out of dp (must divide it), like Megatron's expert DP."""
    cp: int = 1
    """Context-parallel size: ranks that split the sequence inside attention (ring attention)."""

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "pp", "ep", "cp"):
            positive_int(getattr(self, name), f"ParallelSizes.{name}")
        if self.dp % self.ep != 0:
            raise ValueError(
                f"ParallelSizes.ep={self.ep} must divide dp={self.dp}: expert-parallel groups "
                "are carved out of the data-parallel group"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Mesh shape in DIMS order (pp, dp, cp, tp)."""
        return (self.pp, self.dp, self.cp, self.tp)

    def check_world(self, world_size: int) -> None:
        if self.world_size != world_size:
            raise ValueError(
                f"pp={self.pp} x dp={self.dp} x cp={self.cp} x tp={self.tp} = {self.world_size} "
                f"does not equal the world size {world_size}"
            )

    def coords(self, rank: int) -> Coords:
        """(tp, dp, pp, cp) coordinates of a global rank."""
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        return Coords(tp=tp, dp=rest % self.dp, pp=rest // self.dp, cp=cp)

    def rank_of(self, tp: int, dp: int, pp: int, cp: int = 0) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def groups_of(self, dim: str) -> list[list[int]]:
        """Every group of ranks along one mesh dim, in a fixed order (every rank creates them all):
        the other dims' coordinates in row-major order, the ranks of each group in order along `dim`."""
        axis = DIMS.index(dim)
        others = [range(n) for i, n in enumerate(self.shape) if i != axis]
        groups = []
        for rest in itertools.product(*others):
            groups.append([self._flat(rest[:axis] + (j,) + rest[axis:]) for j in range(self.shape[axis])])
        return groups

    def _flat(self, coords: tuple[int, ...]) -> int:
        """The rank at (pp, dp, cp, tp) coordinates: row-major over the mesh shape."""
        rank = 0
        for c, n in zip(coords, self.shape):
            rank = rank * n + c
        return rank

    def tp_groups(self) -> list[list[int]]:
        return self.groups_of("tp")

    def dp_groups(self) -> list[list[int]]:
        return self.groups_of("dp")

    def pp_groups(self) -> list[list[int]]:
        return self.groups_of("pp")

    def cp_groups(self) -> list[list[int]]:
        return self.groups_of("cp")

    def ep_groups(self) -> list[list[int]]:
        out = []
        for ranks in self.dp_groups():
            out += [ranks[i : i + self.ep] for i in range(0, len(ranks), self.ep)]
        return out
