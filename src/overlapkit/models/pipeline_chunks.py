"""The tiny GPT cut into pipeline chunks: the model-side half of `pipeline_parallel` (which cuts any layers).

Nothing here overlaps anything; the engine (`PipelineEngine`) runs the chunks and overlaps their sends
and receives with the other micro-batches' compute.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..pipeline_parallel.schedules import chunks_of
from ..pipeline_parallel.stages import StageLayout, check_rank, split_layers
from .gpt import GPT


class GPTChunk(nn.Module):
    """Some consecutive blocks of a GPT; chunk 0 adds the embeddings, the last chunk the final norm and head.

    forward: token ids [b, s] (chunk 0) or activations [s, b, h] -> activations [s, b, h], or
    logits [s, b, vocab] on the last chunk.
    """

    def __init__(self, model: GPT, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.cfg, self.first, self.last = model.cfg, first, last
        if first:
            self.tok_emb, self.pos_emb, self.enter_blocks = model.tok_emb, model.pos_emb, model.enter_blocks
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        if last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            b, s = x.shape
            if s > self.cfg.seq_len:
                raise ValueError(f"sequence length {s} exceeds GPTConfig.seq_len={self.cfg.seq_len}")
            pos = torch.arange(s, device=x.device)
            x = self.enter_blocks((self.tok_emb(x) + self.pos_emb(pos)).transpose(0, 1))
        for block in self.blocks.values():
            x = block(x)
        # Contiguous: what crosses to the next stage is sent as it is (torch's pipelining requires it).
        return self.head(self.ln_f(x)) if self.last else x.contiguous()


def gpt_chunks(model: GPT, pp: int, rank: int, virtual_stages: int = 1,
               layer_counts: Sequence[int] | None = None, style: str = "loop") -> tuple[list[GPTChunk], StageLayout]:
    """The chunks of a GPT (plain or parallelized) that pipeline rank `rank` holds, in local order.

    `style` "v" (zbv, dualpipev: virtual_stages=2) puts chunks r and 2·pp-1-r on rank r, so rank 0
    holds the embeddings and the head."""
    check_rank(pp, rank, virtual_stages, style)
    counts = split_layers(len(model.blocks), pp, virtual_stages, layer_counts, ends_may_be_empty=True)
    layout = StageLayout(pp=pp, virtual_stages=virtual_stages, counts=counts,
                         first_extra="embeddings", last_extra="final norm + head", style=style)
    n = layout.n_chunks
    chunks = []
    for c in chunks_of(rank, pp, virtual_stages, style):
        chunks.append(GPTChunk(model, layout.layers_of(c), first=c == 0, last=c == n - 1))
        chunks[-1].pipeline_chunk = c
    return chunks, layout
