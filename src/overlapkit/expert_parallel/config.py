"""The configuration of a MoE layer, validated at construction; nothing here overlaps anything."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..runtime.deprecation import deprecated
from ..vocabulary import OVERLAP_MEANING, is_int_at_least, positive_int


CHUNK_CANDIDATES = (1, "ranks", 2, 4, 8)
"""What `chunks="auto"` times on more than one EP rank, in order of preference on a tie (less machinery first)."""

PIPELINED_CHUNKS = 4
"""The chunk count of `overlap="pipelined"` when none is given (the cost model's `moe_chunks` default)."""


def overlap_of_chunks(chunks: int | str) -> dict:
    """The `overlap=` / `chunks=` keywords that mean what an earlier `chunks=` alone meant."""
    if chunks == "auto":
        return {"overlap": "auto"}
    return {"overlap": "none"} if chunks == 1 else {"overlap": "pipelined", "chunks": chunks}


def chunks_for(overlap: str | None, chunks: int | str | None) -> int | str:
    """MoEConfig.chunks for the layer's `overlap` ("none": 1; "pipelined": `chunks`, default
    PIPELINED_CHUNKS; "auto": timed) and its depth knob `chunks`; ValueError naming both when they clash.
    `chunks=` without `overlap=` is the earlier spelling (a DeprecationWarning once)."""
    if overlap is None:
        if chunks is None:
            return "auto"
        deprecated("MoE(chunks=...) without overlap=", f"MoE(**{overlap_of_chunks(chunks)!r})", stacklevel=4)
        return chunks
    if overlap not in OVERLAP_MEANING["ep"]:
        raise ValueError(f"MoE overlap={overlap!r} is not one of {tuple(OVERLAP_MEANING['ep'])}")
    if overlap == "pipelined":
        chunks = PIPELINED_CHUNKS if chunks is None else chunks
        if chunks != "ranks" and not is_int_at_least(chunks, 2):
            raise ValueError(f"MoE chunks={chunks!r} under overlap='pipelined' must be an integer >= 2 or 'ranks' "
                             "(1 chunk is overlap='none')")
        return chunks
    if chunks is not None and not (overlap == "none" and chunks == 1):
        raise ValueError(f"MoE chunks={chunks!r} is for overlap='pipelined'; overlap={overlap!r} sets its own")
    return 1 if overlap == "none" else "auto"


@dataclass(frozen=True)
class MoEConfig:
    """Sizes and schedule of one mixture-of-experts layer (the same on every rank of its EP group)."""

    hidden: int
    """Model width: the size of every token's vector in and out."""
    ffn_hidden: int
    """Inner width of each expert's MLP (of all tensor-parallel ranks together)."""
    num_experts: int
    """Experts in the layer, over all expert-parallel ranks; a multiple of the EP size."""
    top_k: int = 1
    """Experts each token is sent to (1 = Switch, 2 = GShard/Mixtral); at most num_experts."""
    chunks: int | str = "auto"
    """Chunks the dispatch/compute/combine pipeline runs in. 1 is the sequential reference:
    dispatch all, compute all, combine all. With c > 1 the dispatch of chunk i+1 and the combine
    of chunk i-1 are in flight while the experts compute chunk i, forward and backward. "ranks":
    a chunk per source rank, EP-1 point-to-point rounds instead of all-to-alls (as many messages
    as chunks=1; each round hides behind the rows of the round before; pairwise.py). "auto":
    1 on one EP rank (nothing travels, so nothing to hide); on more, each of CHUNK_CANDIDATES is
    timed on the layer's first calls (forward and backward, the slowest rank's median) and the
    fastest kept, the same on every rank (whether chunking pays depends on how fast the transport
    is beside the experts' GEMMs, which no constant knows)."""
    capacity_factor: float | None = None
    """None: dropless (every assignment is computed, however skewed the routing). A number f > 0:
    each expert takes at most ceil(f * tokens * top_k / num_experts) of a rank's assignments,
    top-1 choices first; the rest are dropped, counted in `MoE.last_load.dropped`, never hidden."""
    pad_to_capacity: bool | None = None
    """With a capacity factor: pad every (rank, expert) pair to the capacity, so that every transfer
    has a fixed size and the forward never waits for the device (padded.py); or send exact row
    counts, which costs one host sync per forward. None: padded on CUDA (a host sync stalls the
    GPU's queue), exact on CPU (no device to wait for; padding only adds rows). Needs a capacity."""
    normalize_top_k: bool = True
    """With top_k > 1, rescale a token's k routing weights to sum to 1 (Mixtral); top-1 keeps its
    softmax probability, so that the router gets a gradient from the output."""

    def __post_init__(self) -> None:
        if self.chunks not in ("auto", "ranks") and not is_int_at_least(self.chunks, 1):
            raise ValueError(f"MoEConfig.chunks must be an integer >= 1, 'ranks' or 'auto', got {self.chunks!r}")
        for name in ("hidden", "ffn_hidden", "num_experts", "top_k"):
            positive_int(getattr(self, name), f"MoEConfig.{name}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k={self.top_k} exceeds num_experts={self.num_experts} "
                             f"(allowed: 1 .. {self.num_experts})")
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not 0 < cf < float("inf")):
            raise ValueError(f"MoEConfig.capacity_factor must be None (dropless) or a finite number > 0, got {cf!r}")
        if self.pad_to_capacity is not None and not isinstance(self.pad_to_capacity, bool):
            raise ValueError(f"MoEConfig.pad_to_capacity must be None, True or False, got {self.pad_to_capacity!r}")
        if self.pad_to_capacity and cf is None:
            raise ValueError("MoEConfig.pad_to_capacity=True needs a capacity_factor (dropless routing has no capacity "
                             "to pad to)")

    def padded(self, device_type: str) -> bool:
        """Whether forwards on `device_type` take the capacity-padded path."""
        if self.capacity_factor is None:
            return False
        return self.pad_to_capacity if self.pad_to_capacity is not None else device_type == "cuda"

    def check_parallel(self, ep: int, tp: int = 1) -> None:
        """Raise unless the experts split evenly over `ep` ranks and each expert's MLP over `tp`."""
        if self.num_experts % ep:
            raise ValueError(f"MoEConfig.num_experts={self.num_experts} is not divisible by the expert-parallel "
                             f"size {ep} (each EP rank holds num_experts / ep whole experts)")
        if self.ffn_hidden % tp:
            raise ValueError(f"MoEConfig.ffn_hidden={self.ffn_hidden} is not divisible by the tensor-parallel "
                             f"size {tp} inside the experts")

    def capacity(self, tokens: int) -> int | None:
        """Assignments one expert takes from `tokens` tokens of one rank; None when dropless."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)
