"""How a sequence is cut over the context-parallel ranks, and the global positions of each rank's tokens.

Nothing here overlaps anything: it decides which tokens each rank holds, so that under a causal
mask every rank has the same attention work and therefore the same compute to hide its
key/value transfers behind. The sequence is cut into equal chunks; rank r of P holds

- ``zigzag`` (the two-halves split, as in Megatron CP and torch's head-tail load balancer):
  chunks r and 2P-1-r of 2P, so an early chunk (little to attend to) pairs with a late one
  (much to attend to);
- ``contiguous``: chunk r of P. Right for non-causal attention; under a causal mask rank r
  does r+1 blocks of work and rank 0 waits for the last one.

Chunks of all ranks lie on one grid, so a query chunk and a key chunk are either the same
chunk (causal diagonal), wholly before it (attended in full) or wholly after (skipped).
"""

from __future__ import annotations

import torch

LAYOUTS = ("zigzag", "contiguous")
"""Ways to cut the sequence over the CP ranks."""


def check_layout(layout: str, what: str = "layout") -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"{what}={layout!r} is not one of {LAYOUTS}")


def chunks_per_rank(layout: str) -> int:
    """How many chunks of the grid each rank holds (2 for zigzag, 1 for contiguous)."""
    check_layout(layout)
    return 2 if layout == "zigzag" else 1


def chunks_of(rank: int, size: int, layout: str) -> tuple[int, ...]:
    """The grid chunks rank `rank` of `size` holds, in the order its local tokens are laid out."""
    if not 0 <= rank < size:
        raise ValueError(f"rank={rank} is outside the context-parallel group of size {size}")
    return (rank, 2 * size - 1 - rank) if chunks_per_rank(layout) == 2 else (rank,)


def check_seq_len(seq_len: int, size: int, layout: str, what: str = "sequence length") -> int:
    """The chunk length, or ValueError naming the length when it does not cut into equal chunks."""
    n = size * chunks_per_rank(layout)
    if seq_len < n or seq_len % n:
        raise ValueError(
            f"{what} {seq_len} does not split over cp={size} with layout={layout!r}: it must be a positive "
            f"multiple of {n} ({chunks_per_rank(layout)} equal chunk(s) per rank); pad it or pick another cp size")
    return seq_len // n


def positions(seq_len: int, rank: int, size: int, layout: str, device=None) -> torch.Tensor:
    """Global positions (int64) of rank `rank`'s tokens, in its local order: what RoPE / position embeddings need."""
    c = check_seq_len(seq_len, size, layout)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunks_of(rank, size, layout)])


def shard(x: torch.Tensor, dim: int, rank: int, size: int, layout: str) -> torch.Tensor:
    """This rank's tokens of the whole sequence `x` (sequence along `dim`), in its local order."""
    c = check_seq_len(x.shape[dim], size, layout, what=f"sequence length (dim {dim} of a {tuple(x.shape)} tensor)")
    return torch.cat([x.narrow(dim, i * c, c) for i in chunks_of(rank, size, layout)], dim=dim)


def unshard(parts: list[torch.Tensor], dim: int, layout: str) -> torch.Tensor:
    """The whole sequence from every rank's local tokens (`parts[r]` from rank r), e.g. to check a result."""
    size = len(parts)
    per = chunks_per_rank(layout)
    pieces: dict[int, torch.Tensor] = {}
    for r, part in enumerate(parts):
        for chunk, piece in zip(chunks_of(r, size, layout), part.chunk(per, dim=dim)):
            pieces[chunk] = piece
    return torch.cat([pieces[i] for i in range(size * per)], dim=dim)
