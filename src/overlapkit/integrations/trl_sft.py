"""TRL's SFTTrainer on an overlapkit model: its per-token log-probabilities from the
vocabulary-parallel cross-entropy, so the output head stays split and its logits are never
gathered for the loss.

TRL replaces the model's forward with a fused LM head that gathers the head's weight and scores
the backbone's last hidden state; on a sequence-parallel model that state is this rank's slice
of the sequence, and on any vocabulary-split head it bypasses overlapkit's loss. The forward
installed here answers TRL's `fused_lm_head=True` call with the same fields (`log_probs`,
`label_mask`, `entropy`, `is_top1`) from the model's own vocabulary-split logits: log-probs
through `vocab_parallel_cross_entropy`, the two metrics under no_grad from the whole logits
(one all-gather of [tokens, V] per micro-batch, for the metrics only).
"""

from __future__ import annotations

import functools
import types

import torch
from torch import nn
from trl import SFTTrainer

from ..tensor_parallel.vocab import vocab_parallel_cross_entropy
from .hf_trainer import OverlapTrainerMixin


def _whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _metrics(logits, targets, mask):
    """Entropy of the predicted distribution and whether the label is its argmax, per token (no grad)."""
    with torch.no_grad():
        whole = _whole(logits).float()
        log_p = torch.log_softmax(whole, dim=-1)
        entropy = -(log_p.exp() * log_p).sum(-1).masked_fill(~mask, 0.0)
        is_top1 = (whole.argmax(-1) == targets) & mask
    return entropy, is_top1


def _forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
    forward = type(self).forward
    if not fused_lm_head:
        extra = dict(labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch)
        return forward(self, *args, **kwargs, **{k: v for k, v in extra.items() if v is not None})
    from trl.trainer.utils import FusedCausalLMOutput

    kwargs["use_cache"] = False
    logits = forward(self, *args, **kwargs).logits  # [b, s, V/tp] columns of this rank, whole sequence
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    targets = shift_labels.to(logits.device)
    mask = targets != -100
    log_probs = -vocab_parallel_cross_entropy(logits, targets, reduction="none")  # 0 where ignored
    entropy, is_top1 = _metrics(logits, targets, mask)
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return FusedCausalLMOutput(loss=-log_probs.sum() / count, log_probs=log_probs, entropy=entropy,
                               log_sum_sq_probs=None, mean_logits=None, is_top1=is_top1, label_mask=mask,
                               aux_loss=None)


def install_vocab_parallel_head(model: nn.Module) -> None:
    """Make `model(..., fused_lm_head=True)` (TRL's call) score through the vocabulary-parallel loss."""
    head = model.get_output_embeddings()
    if not hasattr(head.weight, "device_mesh"):
        raise ValueError(f"{type(model).__name__}'s output head is not split over the vocabulary: parallelize the "
                         "model with overlapkit first")
    model.forward = types.MethodType(functools.wraps(type(model).forward)(_forward), model)


class OverlapSFTTrainer(OverlapTrainerMixin, SFTTrainer):
    """TRL's `SFTTrainer` on an overlapkit model: `OverlapSFTTrainer(model=, args=SFTConfig(...), groups=, ...)`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        install_vocab_parallel_head(self.model)
