"""Cut a model into pipeline chunks: pp stages, or pp × v virtual stages for the interleaved
schedule (rank r holds chunks r, r + pp, r + 2·pp, ...), or two chunks a rank in a V for zbv and
dualpipev (rank r holds chunks r and 2·pp - 1 - r). Nothing here communicates; the cut decides
how much compute each stage has to hide its neighbours' transfers behind.

Chunks keep the parameter names of the model they came from (blocks live in a ModuleDict keyed
by their index there), so a chunk's gradients compare with the unsplit model's by name and
`models.expected_local` works on a chunk of a tensor-parallel GPT unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from .schedules import chunks_of


@dataclass(frozen=True)
class StageLayout:
    """Which layers each chunk holds: the cut, stated."""

    pp: int
    """Pipeline ranks."""
    virtual_stages: int
    """Chunks per rank (v); pp * v chunks in all."""
    counts: tuple[int, ...]
    """Layers (blocks) in each global chunk, in chunk order."""
    first_extra: str = ""
    """What chunk 0 holds besides its blocks (the GPT's embeddings)."""
    last_extra: str = ""
    """What the last chunk holds besides its blocks (the GPT's final norm and head)."""
    style: str = "loop"
    """Which rank holds which chunk: "loop" (chunk c on rank c % pp) or "v" (c and 2·pp-1-c on one rank)."""

    @property
    def n_chunks(self) -> int:
        return self.pp * self.virtual_stages

    def rank_of(self, chunk: int) -> int:
        return next(r for r in range(self.pp) if chunk in chunks_of(r, self.pp, self.virtual_stages, self.style))

    def layers_of(self, chunk: int) -> range:
        """Indices (in the unsplit model) of the blocks of a global chunk."""
        start = sum(self.counts[:chunk])
        return range(start, start + self.counts[chunk])

    def describe(self) -> str:
        """One line per chunk: rank, block indices, embedding/head."""
        lines = []
        for c in range(self.n_chunks):
            r = self.layers_of(c)
            parts = [self.first_extra] if c == 0 and self.first_extra else []
            parts.append(f"blocks {r.start}-{r.stop - 1}" if len(r) else "no blocks")
            if c == self.n_chunks - 1 and self.last_extra:
                parts.append(self.last_extra)
            lines.append(f"chunk {c} (rank {self.rank_of(c)}): {len(r)} layers: {' + '.join(parts)}")
        return "\n".join(lines)


def split_layers(n_layers: int, pp: int, virtual_stages: int = 1, counts: Sequence[int] | None = None,
                 *, ends_may_be_empty: bool = False) -> tuple[int, ...]:
    """Layers per chunk: `counts` checked, or an even cut whose remainder goes to the middle chunks.

    The first and last chunks get the fewest layers of an uneven cut because they also carry
    the embedding and the head. `ends_may_be_empty`: the first and last chunk may hold no layer
    (they still compute the embedding / head); a middle chunk never may.
    """
    n_chunks = pp * virtual_stages
    if counts is not None:
        counts = tuple(counts)
        if len(counts) != n_chunks or any(not isinstance(c, int) or c < 0 for c in counts) \
                or sum(counts) != n_layers:
            raise ValueError(f"layer_counts={list(counts)} must be {n_chunks} integers >= 0 (pp={pp} x "
                             f"virtual_stages={virtual_stages}) summing to the model's {n_layers} layers")
    else:
        if n_layers < n_chunks:
            raise ValueError(f"cannot split {n_layers} layers into pp={pp} x virtual_stages={virtual_stages} = "
                             f"{n_chunks} chunks of at least one layer; pass layer_counts or use fewer chunks")
        base, extra = divmod(n_layers, n_chunks)
        # The remainder goes to the chunks nearest the middle, so the ends (embedding/head) stay light.
        order = sorted(range(n_chunks), key=lambda c: (abs(2 * c - (n_chunks - 1)), c))
        counts = tuple(base + (c in order[:extra]) for c in range(n_chunks))
    for c, k in enumerate(counts):
        end = c in (0, n_chunks - 1)
        if k == 0 and not (end and ends_may_be_empty):
            raise ValueError(f"layer_counts={list(counts)}: chunk {c} would hold no layer "
                             f"({'only the first and last chunk of a GPT may' if ends_may_be_empty else 'every chunk needs one'})")
    return counts


class SequentialChunk(nn.Module):
    """Some consecutive layers of an nn.Sequential-like list, applied in order (one tensor in, one out).

    Children are named by their index in the list ("3.weight"), as in the nn.Sequential.
    """

    def __init__(self, layers: dict[int, nn.Module]) -> None:
        super().__init__()
        for i, m in layers.items():
            self.add_module(str(i), m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.children():
            x = layer(x)
        return x


def sequential_chunks(layers: Sequence[nn.Module], pp: int, rank: int, virtual_stages: int = 1,
                      layer_counts: Sequence[int] | None = None,
                      style: str = "loop") -> tuple[list[SequentialChunk], StageLayout]:
    """The chunks of an nn.Sequential (or list of layers) that pipeline rank `rank` holds, in local order."""
    check_rank(pp, rank, virtual_stages, style)
    layers = list(layers)
    layout = StageLayout(pp=pp, virtual_stages=virtual_stages,
                         counts=split_layers(len(layers), pp, virtual_stages, layer_counts), style=style)
    chunks = []
    for c in chunks_of(rank, pp, virtual_stages, style):
        chunks.append(SequentialChunk({i: layers[i] for i in layout.layers_of(c)}))
        chunks[-1].pipeline_chunk = c
    return chunks, layout


def check_rank(pp: int, rank: int, virtual_stages: int, style: str) -> None:
    """Raise ValueError naming the value when `rank` cannot hold chunks of this layout."""
    if not isinstance(pp, int) or pp < 1 or not 0 <= rank < pp:
        raise ValueError(f"pipeline rank={rank!r} must be in [0, pp={pp!r})")
    if style not in ("loop", "v"):
        raise ValueError(f"style={style!r} must be 'loop' or 'v'")
    if style == "v" and virtual_stages != 2:
        raise ValueError(f"style='v' places two chunks a rank: virtual_stages={virtual_stages} must be 2")


def balanced_counts(n_layers: int, n_chunks: int, layer_cost: float, first_extra: float = 0.0,
                    last_extra: float = 0.0) -> tuple[int, ...]:
    """Layers per chunk that make the slowest chunk as fast as it can be, each chunk costing its
    layers times `layer_cost`, plus `first_extra` on chunk 0 (the embeddings) and `last_extra` on the
    last (the head and loss); every chunk keeps at least one layer. Among the cuts as slow as the best,
    the most even one (least sum of squared chunk costs)."""
    if n_layers < n_chunks:
        raise ValueError(f"cannot split {n_layers} layers into {n_chunks} chunks of at least one layer")
    extra = [0.0] * n_chunks
    extra[0] += first_extra
    extra[-1] += last_extra
    # best[k]: (slowest, sum of squares, counts) of the chunks so far holding k layers in all.
    best = {0: (0.0, 0.0, ())}
    for c in range(n_chunks):
        nxt = {}
        for used, (slow, sq, counts) in best.items():
            for k in range(1, n_layers - used - (n_chunks - 1 - c) + 1):
                cost = extra[c] + k * layer_cost
                cand = (max(slow, cost), sq + cost * cost, counts + (k,))
                key = used + k
                if key not in nxt or cand[:2] < nxt[key][:2]:
                    nxt[key] = cand
        best = nxt
    return best[n_layers][2]
