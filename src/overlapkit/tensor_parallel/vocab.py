"""Vocabulary-parallel embedding and cross-entropy: the [tokens, vocab] logits are never gathered.

Nothing here overlaps anything; it removes communication instead:
the output head is split over the vocabulary, and the loss is computed from the local shards
with three [tokens]-sized reductions (max, sum of exponentials, the target's logit: one MAX
all-reduce and one SUM all-reduce of two rows) instead of an all-gather of [tokens, vocab].
Its backward needs no communication at all: softmax minus one-hot, on the local columns.

The embedding is split the same way (rows = vocabulary): each rank looks up the tokens that
fall in its rows, writes zeros for the others, and the partial embeddings are summed over TP.
Both split the vocabulary into equal contiguous blocks, rank r owning [r*V/tp, (r+1)*V/tp).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..runtime import comm
from ..runtime.agreement import Agreement
from ..runtime.entry import check_inputs
from ..runtime.groups import resolve_group
from .collectives import all_reduce_copy
from .mappings import check_divisible, reduce_from_tp
from .params import LocalShardParams, is_dtensor, make_param, mesh_and_group

REDUCTIONS = ("mean", "sum", "none")
"""Accepted values of vocab_parallel_cross_entropy's `reduction` (as torch's cross_entropy)."""

_CE_AGREEMENT = Agreement("vocab_parallel_cross_entropy")
"""Shapes this process has already compared across ranks (the first call of a shape checks)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t  # isinstance, which dynamo traces (hasattr it does not)


def vocab_range(vocab_size: int, group) -> tuple[int, int]:
    """[start, end) of the vocabulary rows this rank of `group` owns."""
    ws, r = comm.group_size(group), comm.group_rank(group)
    check_divisible(vocab_size, ws, "vocabulary size")
    per = vocab_size // ws
    return r * per, (r + 1) * per


class VocabParallelEmbedding(LocalShardParams, nn.Module):
    """nn.Embedding with its rows (the vocabulary) split over TP; the output is replicated.

    Forward: local lookup of the ids in this rank's rows, zeros elsewhere, then an all-reduce
    (Megatron's g). Backward: no communication (the output gradient is already replicated).
    The weight is a DTensor sharded on dim 0 (Shard(0)), like a column-parallel output head's,
    so the two can be tied. `padding_idx` is nn.Embedding's: that row starts at zero and gets no
    gradient (on the rank that holds it).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, mesh_or_group=None, *, name: str = "embedding",
                 padding_idx: int | None = None, device=None, dtype=None) -> None:
        super().__init__()
        from torch.distributed.tensor import Shard

        self.mesh, self.group = mesh_and_group(mesh_or_group)
        self.tp_size, self.tp_rank = comm.group_size(self.group), comm.group_rank(self.group)
        self.num_embeddings, self.embedding_dim, self.name = num_embeddings, embedding_dim, name
        self.vocab_start, self.vocab_end = vocab_range(num_embeddings, self.group)
        if padding_idx is not None and not -num_embeddings <= padding_idx < num_embeddings:
            raise ValueError(f"{name}: padding_idx={padding_idx} is outside the vocabulary [0, {num_embeddings})")
        self.padding_idx = padding_idx % num_embeddings if padding_idx is not None else None
        """nn.Embedding's padding_idx (a global id): that row starts at zero and its gradient stays zero."""
        local_pad = None if self.padding_idx is None else self.padding_idx - self.vocab_start
        self._local_padding_idx = local_pad if local_pad is not None and 0 <= local_pad < self.vocab_end - \
            self.vocab_start else None
        """padding_idx in this rank's rows, or None where another rank holds it."""
        self._init_state_dict_hooks()
        self._placements["weight"] = [Shard(0)]
        local = torch.empty(self.vocab_end - self.vocab_start, embedding_dim, device=device, dtype=dtype)
        self.weight = make_param(local, self.mesh, [Shard(0)], (num_embeddings, embedding_dim))
        if local.device.type != "meta":
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """nn.Embedding's N(0, 1) init drawn for the FULL table, this rank keeping its rows."""
        w = self.local_data("weight")
        full = torch.empty(self.num_embeddings, self.embedding_dim, device=w.device, dtype=w.dtype).normal_()
        if self.padding_idx is not None:
            full[self.padding_idx].zero_()
        w.copy_(self.shard_of(full))

    def _global_shape(self, name: str):
        return (self.num_embeddings, self.embedding_dim)

    @classmethod
    def from_full(cls, embedding: nn.Embedding, mesh_or_group, **kwargs) -> "VocabParallelEmbedding":
        """This rank's rows of an unsharded nn.Embedding (same dtype and device)."""
        if embedding.max_norm is not None or embedding.sparse:
            raise ValueError("VocabParallelEmbedding.from_full: max_norm and sparse embeddings are not supported "
                             f"(got max_norm={embedding.max_norm}, sparse={embedding.sparse})")
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, mesh_or_group, device="meta",
                    padding_idx=embedding.padding_idx, dtype=embedding.weight.dtype, **kwargs)
        layer.to_empty(device=embedding.weight.device)
        with torch.no_grad():
            layer.local_data("weight").copy_(layer.shard_of(embedding.weight))
        return layer

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full [vocab, dim] weight (or its gradient)."""
        return full[self.vocab_start:self.vocab_end]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{self.name}: token ids must be int32/int64, got {ids.dtype}")
        if self.tp_size == 1:  # every row is here: nothing to mask or sum
            return F.embedding(ids, self.local(self.weight), self._local_padding_idx)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        # Ids another rank holds look up row 0 here and are zeroed below (their gradient too).
        out = F.embedding(local_ids, self.local(self.weight), self._local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group, self.name)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_size}, "
                f"rows=[{self.vocab_start}, {self.vocab_end})")


def _logits_group(logits: torch.Tensor, mesh_or_group):
    """The TP group of the logits: from the call, or from a DTensor's mesh (which must then agree)."""
    if not is_dtensor(logits):
        return resolve_group(mesh_or_group, "tp")
    mesh = logits.device_mesh
    from torch.distributed.tensor import Shard
    if mesh.ndim != 1 or tuple(logits.placements) != (Shard(logits.dim() - 1),):
        raise ValueError(f"vocab_parallel_cross_entropy: DTensor logits must be sharded on their last dim over a "
                         f"1-D mesh, got placements {tuple(logits.placements)} on {mesh}")
    if torch.compiler.is_compiling():
        # Comparing the ranks of two groups cannot be traced; eager runs compare them.
        return mesh.get_group() if mesh_or_group is None else resolve_group(mesh_or_group, "tp")
    group = mesh.get_group()
    if mesh_or_group is not None:
        given = dist.get_process_group_ranks(resolve_group(mesh_or_group, "tp"))
        if given != dist.get_process_group_ranks(group):
            raise ValueError(f"vocab_parallel_cross_entropy: the logits are a DTensor on a mesh of ranks "
                             f"{mesh.mesh.tolist()}, but the group passed has ranks {given}")
    return group


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross entropy from vocabulary shards; forward reduces [tokens] rows, backward nothing."""

    @staticmethod
    def forward(ctx, logits, targets, group, ignore_index):
        # fp32 whatever the logits' dtype: exp-sums over a large vocabulary lose too much in bf16.
        x = logits.float()
        vl = x.shape[-1]
        start = comm.group_rank(group) * vl
        local_max = all_reduce_copy(x.max(dim=-1).values, group, "vocab_ce.fwd.max", op="max")
        x = x - local_max.unsqueeze(-1)
        mine = (targets >= start) & (targets < start + vl)
        idx = (targets - start).masked_fill(~mine, 0).unsqueeze(-1)
        target_logit = x.gather(-1, idx).squeeze(-1).masked_fill(~mine, 0.0)
        exp = x.exp()
        sums = all_reduce_copy(torch.stack([exp.sum(-1), target_logit]), group, "vocab_ce.fwd.sum")
        sum_exp, target_logit = sums.unbind(0)
        ignored = targets == ignore_index
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        exp.div_(sum_exp.unsqueeze(-1))  # the softmax, kept for backward in place of the logits
        ctx.save_for_backward(exp, idx, mine, ignored)
        ctx.in_dtype = logits.dtype
        ctx.mark_non_differentiable(ignored)
        return loss, ignored

    @staticmethod
    def backward(ctx, grad_loss, _):
        softmax, idx, mine, ignored = ctx.saved_tensors
        # d loss / d logit = softmax - onehot(target), scaled per token; out of place, so that a
        # second backward (retain_graph) finds the softmax unchanged.
        grad = softmax.scatter_add(-1, idx, -mine.unsqueeze(-1).to(softmax.dtype))
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, mesh_or_group=None, *,
                                 ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """torch's cross_entropy over the vocabulary, from this rank's columns of the logits.

    `local_logits` [..., V/tp] are this rank's contiguous block of the vocabulary (what a
    vocabulary-split output head gives: rank r holds columns [r*V/tp, (r+1)*V/tp)); `targets`
    [...] are global token ids (or `ignore_index`). Every rank returns the same loss, computed
    in fp32; the gradient reaching `local_logits` is this rank's columns of the full one.
    `mesh_or_group`: the TP group, a 1-D DeviceMesh, a mesh with a "tp" dim or a ParallelGroups;
    it may be left out when `local_logits` is a DTensor sharded on its last dim (what the
    built-in plans' output heads return), whose mesh then says the group.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"vocab_parallel_cross_entropy: reduction={reduction!r} is not one of {REDUCTIONS}")
    group = _logits_group(local_logits, mesh_or_group)
    local_logits = _local(local_logits)
    if tuple(targets.shape) != tuple(local_logits.shape[:-1]):
        raise ValueError(f"vocab_parallel_cross_entropy: targets have shape {tuple(targets.shape)}, the logits "
                         f"{tuple(local_logits.shape)}: targets must be the logits' shape without the vocab dim")
    if targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"vocab_parallel_cross_entropy: targets must be int32/int64 token ids, got {targets.dtype}")
    vocab = local_logits.shape[-1] * comm.group_size(group)
    if comm.group_size(group) == 1:
        # The whole vocabulary is here: torch's own loss (in fp32, as below), which refuses a target
        # outside the vocabulary itself (an IndexError on CPU, a device-side assert on a GPU).
        loss = F.cross_entropy(local_logits.float().reshape(-1, vocab), targets.reshape(-1),
                               ignore_index=ignore_index, reduction=reduction)
        return loss.view(targets.shape) if reduction == "none" else loss
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
    # An id no rank's block holds would be scored as if its logit were 0: refuse it, never sum that.
    if targets.device.type == "cpu" and not torch.compiler.is_compiling():
        if bool(bad.any()):
            raise ValueError(f"vocab_parallel_cross_entropy: target ids must be in [0, {vocab}) or ignore_index="
                             f"{ignore_index}; got {targets[bad][:4].tolist()}")
    else:
        # On a GPU a host check would stall the host every step and cannot be captured in a CUDA
        # graph, and under torch.compile it would break the graph; a device-side assert (what
        # torch's own cross_entropy does) needs neither.
        torch._assert_async(~bad.any(), f"vocab_parallel_cross_entropy: a target id is outside [0, {vocab}) "
                                        f"and is not ignore_index={ignore_index}")
    if not torch.compiler.is_compiling():  # compiled, the all-reduce ops compare their shapes themselves
        # A rank with another shape would meet the others' all-reduce with the wrong byte count.
        _CE_AGREEMENT.check(group, logits=tuple(local_logits.shape), ignore_index=ignore_index,
                            reduction=reduction)
        # TP ranks scoring different targets would each add another token's logit: one tiny gather says so.
        check_inputs(group, "vocab_parallel_cross_entropy", (local_logits, targets))
    loss, ignored = _VocabParallelCE.apply(local_logits, targets, group, ignore_index)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    # torch's mean: over the tokens that are not ignored (NaN when all are, as torch gives).
    return loss.sum() / (~ignored).sum()
