"""A Hugging Face causal LM cut into pipeline chunks from its config's `base_model_pp_plan`: the
model-side half of `pipeline_parallel` for a user's model (pipeline_chunks.py is our GPT's).

Nothing here overlaps anything; the engine runs the chunks and hides their sends and receives
under the other micro-batches' compute. The plan names the base model's modules in order: what
comes before the decoder layers (the embeddings) goes on the first chunk, the layers are cut
into chunks, what comes after them (the final norm) and the output head go on the last chunk.
Every chunk recomputes what the base model's forward computes once for all layers (positions,
rotary embeddings, the causal or sliding-window masks) from the step's sequence length, so that
only one tensor crosses between stages. Parameter names stay the model's ("model.layers.3...").
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

LOGIT_FIELDS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config fields by which a causal LM's head transforms its logits (Gemma 2/3, Cohere, Granite)."""


@dataclass
class StepShape:
    """What every chunk of one pipeline needs to know of the step in hand and cannot see in its input
    (under sequence parallelism a middle chunk receives a slice of the sequence)."""

    seq_len: int = 0
    """Tokens per sequence of this step (set before the step runs)."""


@dataclass(frozen=True)
class PPParts:
    """The modules a `base_model_pp_plan` names, resolved on one model."""

    prefix: str
    """The base model's attribute on the causal LM ("model")."""
    before: tuple[str, ...]
    """Base-model modules applied before the decoder layers (the embeddings), in order."""
    layers: str
    """The base model's ModuleList of decoder layers."""
    after: tuple[str, ...]
    """Base-model modules applied after the decoder layers (the final norm), in order."""
    head: str
    """The causal LM's output head attribute ("lm_head")."""


def pp_parts(model: nn.Module) -> PPParts:
    """The parts of `model` its config's `base_model_pp_plan` names; ValueError naming what is missing."""
    cls = type(model).__name__
    cfg = getattr(model, "config", None)
    plan = getattr(cfg, "base_model_pp_plan", None)
    if not plan:
        raise ValueError(f"pipeline: {cls} has no pipeline plan ({type(cfg).__name__}.base_model_pp_plan is "
                         f"{plan!r}); cut it by hand with overlapkit.pipeline_parallel.sequential_chunks")
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    if base is None:
        raise ValueError(f"pipeline: {cls} has no base model at base_model_prefix={prefix!r}")
    names = list(plan)
    missing = [n for n in names if getattr(base, n, None) is None]
    if missing:
        raise ValueError(f"pipeline: {cls}'s base_model_pp_plan names {missing}, which its base model lacks")
    lists = [i for i, n in enumerate(names) if isinstance(getattr(base, n), nn.ModuleList)]
    if len(lists) != 1:
        raise ValueError(f"pipeline: {cls}'s base_model_pp_plan {names} must name exactly one list of decoder "
                         f"layers; it names {[names[i] for i in lists]}")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_name = next((n for n, m in model.named_children() if m is head), None) if head is not None else None
    if head_name is None:
        raise ValueError(f"pipeline: {cls} has no output head (get_output_embeddings()); pipeline() cuts causal LMs")
    i = lists[0]
    return PPParts(prefix, tuple(names[:i]), names[i], tuple(names[i + 1:]), head_name)


class HFStage(nn.Module):
    """Consecutive decoder layers of a causal LM; the first chunk adds the embeddings, the last the
    final norm and the head.

    forward: token ids [b, s] (first chunk) or hidden states [b, s', h] -> hidden states, or the
    logits [b, s, vocab] (a DTensor over the vocabulary under tensor parallelism) on the last chunk.
    """

    def __init__(self, model: nn.Module, parts: PPParts, layers: range, first: bool, last: bool,
                 shape: StepShape) -> None:
        super().__init__()
        base = getattr(model, parts.prefix)
        self.config, self.parts, self.first, self.last, self.shape = model.config, parts, first, last, shape
        holder = nn.Module()
        for name in parts.before if first else ():
            holder.add_module(name, getattr(base, name))
        holder.add_module(parts.layers, nn.ModuleDict({str(i): getattr(base, parts.layers)[i] for i in layers}))
        for name in parts.after if last else ():
            holder.add_module(name, getattr(base, name))
        rotary = getattr(base, "rotary_emb", None)
        if rotary is not None:  # every chunk computes the positions' rotation itself (buffers only)
            holder.add_module("rotary_emb", rotary)
        self.add_module(parts.prefix, holder)
        if last:
            self.add_module(parts.head, getattr(model, parts.head))
        self._layer_ids = list(layers)
        self._rotary_by_type = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        holder = getattr(self, self.parts.prefix)
        h = x
        for name in self.parts.before if self.first else ():
            h = getattr(holder, name)(h)
        if self.first and getattr(self.config, "embedding_multiplier", None) is not None:
            h = h * self.config.embedding_multiplier  # Granite scales the embeddings in its base forward
        seq = self.shape.seq_len or h.shape[1]
        pos = torch.arange(seq, device=h.device).unsqueeze(0)
        layers = getattr(holder, self.parts.layers)
        masks, rotary = {}, {}
        for i in self._layer_ids:
            kind = self._layer_type(i)
            if kind not in masks:
                masks[kind] = self._mask(kind, h, seq, pos)
                rotary[kind] = self._rotary(kind, h, pos)
            out = layers[str(i)](h, attention_mask=masks[kind], position_ids=pos, position_embeddings=rotary[kind])
            h = out[0] if isinstance(out, tuple) else out
        if not self.last:
            return h.contiguous()  # sent as it is (torch's pipelining requires it contiguous)
        for name in self.parts.after:
            h = getattr(holder, name)(h)
        return self._logits(getattr(self, self.parts.head)(h))

    def _layer_type(self, i: int) -> str:
        types = getattr(self.config, "layer_types", None)
        if types:
            return types[i]
        # Mistral, Phi-3, Starcoder2: one mask for every layer, sliding when the config has a window.
        return "sliding_attention" if getattr(self.config, "sliding_window", None) is not None else "full_attention"

    def _mask(self, kind: str, h: torch.Tensor, seq: int, pos: torch.Tensor):
        from transformers import masking_utils

        make = masking_utils.create_sliding_window_causal_mask if kind == "sliding_attention" \
            else masking_utils.create_causal_mask
        # The mask reads batch, dtype and device from its input; the sequence is the step's whole one.
        probe = torch.empty((h.shape[0], seq, 1), dtype=_local(h).dtype, device=h.device)
        return make(self.config, probe, None, None, position_ids=pos)

    def _rotary(self, kind: str, h: torch.Tensor, pos: torch.Tensor):
        rotary = getattr(getattr(self, self.parts.prefix), "rotary_emb", None)
        if rotary is None:
            return None
        h = _local(h)
        return rotary(h, pos, kind) if self._rotary_by_type else rotary(h, pos)

    def _logits(self, logits):
        cfg = self.config
        if getattr(cfg, "logit_scale", None) is not None:
            logits = logits * cfg.logit_scale
        if getattr(cfg, "logits_scaling", None) is not None:
            logits = logits / cfg.logits_scaling
        cap = getattr(cfg, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def check_cut_matches(model: nn.Module, stages: list[HFStage], shape: StepShape, tokens: int) -> None:
    """Run the whole model and the chunks, one after the other, on the same small input; ValueError
    naming the model class when the logits differ: a forward the chunks do not reproduce is refused,
    never trained silently wrong.

    Collective over the tensor-parallel group when the model is parallelized (both forwards are)."""
    vocab = model.config.vocab_size
    ids = (torch.arange(tokens) * 7 + 3).remainder(vocab).unsqueeze(0)
    device = next(model.parameters()).device
    ids = ids.to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            # labels=: a parallelized model then keeps its logits split over the vocabulary, as the chunks do.
            want = _local(model(input_ids=ids, labels=ids).logits)
            shape.seq_len = tokens
            h = ids
            for stage in stages:
                h = stage(h)
            got = _local(h)
    finally:
        shape.seq_len = 0
        model.train(was_training)
    err = ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item() \
        if got.shape == want.shape else float("inf")
    if not err <= 1e-5:
        fields = {f: getattr(model.config, f) for f in ("model_type", *LOGIT_FIELDS) if hasattr(model.config, f)}
        raise ValueError(f"pipeline: {type(model).__name__}'s forward is not what its base_model_pp_plan cut "
                         f"computes (logits differ by {err:.2e} relative on a probe of {tokens} tokens; {fields}): "
                         "this model's forward does more than embeddings, decoder layers, final norm and head")
