"""A prompt in the decode layout as two micro-batches: one half's all-reduce in flight while the other half computes.

`InferenceConfig(prefill="two_batch")`. A prefill forward has no backward to hide its collectives
behind, and a decoder layer's all-reduce gates the next GEMM of the same tokens; but not of other
tokens. Each fused decoder layer (models/hf_decode.py) cuts its batch's sequences in two, A (the
first half, rounded up) and B, and runs them in turn on the one thread:

    A: norm, attention -> reduce A1 ->|                        |-> wait A1, add+norm, MLP -> reduce A2 ->|
    B:                                |-> norm, attention      |                                         |-> wait B1,
                                      |   -> reduce B1         |                                         |   add+norm, MLP -> reduce B2
    then wait A2, add; the NEXT layer's A: norm, attention -> reduce A1'; wait B2, add

so A1 flies under B's attention, B1 under A's MLP, A2 under B's MLP, and B2 under the next layer's first
half (`Ahead`: started by this layer, taken by the next only when it is called with this layer's output and
the same argument objects; the last layer's B2 flies under A's add alone). Every rank issues the same
collectives in the same order (A1, B1, A2, A1', B2, B1', ...). The micro-batches are the
same computation as one batch (each sequence attends only to itself; only the GEMMs' row counts
differ), so the tokens equal the one-batch tokens.

The KV cache: each half's attention hands its keys and values to a stand-in (`_HalfCache`) that returns
them as they are (a prompt into an empty dynamic cache attends to its own keys only); after both halves
the layer's keys and values are written to the real cache in one update, in batch order, so the cache
holds what one batch would have stored. Where that does not hold, the layer runs one batch: a cache that
is not transformers' own `DynamicCache` or already holds tokens, one sequence, a layer argument of a
kind not known to be per sequence, or an output collector recording attention outputs.
"""

from __future__ import annotations

import inspect
import re

import torch

from ..inference.fused import add_norm, start_reduce
from ..runtime import state as process_state
from ..runtime.recorder import compute_span

SPLIT_KWARGS = ("attention_mask", "position_ids", "position_embeddings")
"""Layer arguments cut with the batch (dim 0 the batch, or 1 when broadcast over it)."""
CACHE_KWARGS = ("past_key_values", "cache")
"""The KV cache's argument, by the names transformers releases give it (5.17: past_key_values; 5.25: cache)."""
SHARED_KWARGS = ("cache_position", "use_cache", "output_attentions", *CACHE_KWARGS)
"""Layer arguments every sequence shares (the cache handed through its stand-in)."""


def eligible(batch: int, seq: int, cache) -> bool:
    """Whether a forward of `batch` sequences of `seq` tokens into `cache` may run as two micro-batches
    (checked once per forward; each layer checks its own arguments too)."""
    if batch < 2 or seq < 2:
        return False
    if cache is None:
        return True
    try:
        from transformers import DynamicCache
    except ImportError:
        return False
    # exactly the dynamic cache: its update of an empty layer stores the keys given and returns them
    return type(cache) is DynamicCache and cache.get_seq_length() == 0


_ATTENTION_USES_UPDATE_ONLY: dict[type, bool] = process_state.cache_dict("inference.attention_cache_use")
"""Attention class -> whether its forward touches the KV cache only through `update` (what `_HalfCache` stands in for)."""


def attention_splits(attention) -> bool:
    """Whether this attention's forward may run on a half batch behind a `_HalfCache`: its source reaches the
    cache only by calling `update` (no isinstance test of it, no reach into its layers), read once per class."""
    cls = type(attention)
    if cls not in _ATTENTION_USES_UPDATE_ONLY:
        try:
            src = inspect.getsource(inspect.unwrap(cls.forward))
        except (OSError, TypeError):
            src = ""
        uses = re.findall(r"\b(?:past_key_values?|cache)\b(\.\w+|\[|\))?", src)
        _ATTENTION_USES_UPDATE_ONLY[cls] = bool(src) and "isinstance(" not in \
            "".join(line for line in src.splitlines() if re.search(r"\b(?:past_key_values?|cache)\b", line)) and \
            all(u in ("", ".update", ")") for u in uses)
    return _ATTENTION_USES_UPDATE_ONLY[cls]


def _collecting_attention() -> bool:
    """An output collector records something other than hidden states (the attention modules' outputs would
    be recorded once per half), or the collector cannot be read: then one batch."""
    try:
        from transformers.utils import output_capturing

        collected = output_capturing._active_collector.get()
    except (ImportError, AttributeError):
        return True
    return bool(collected) and any(k != "hidden_states" and not k.startswith("_") for k in collected)


class _HalfCache:
    """The KV cache one half's attention sees: `update` keeps the half's keys and values and returns them
    (the prompt attends to itself alone); everything else is the real cache's."""

    def __init__(self, cache) -> None:
        self._cache, self.kept = cache, None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.kept = (key_states, value_states, layer_idx, args, kwargs)
        return key_states, value_states

    def __getattr__(self, name):
        return getattr(self._cache, name)


def _cut(value, rows: slice, batch: int):
    """`value` for the sequences `rows` (a tensor with the batch in dim 0, or 1 there when broadcast; a tuple
    of such), or raise LookupError when it is neither."""
    if isinstance(value, tuple):
        return tuple(_cut(v, rows, batch) for v in value)
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] not in (1, batch):
        raise LookupError
    return value if value.shape[0] == 1 else value[rows]


def split_kwargs(kwargs: dict, batch: int, rows: tuple[slice, slice]) -> tuple[dict, dict] | None:
    """The layer's arguments for each half, its cache behind a `_HalfCache`; None when some argument is not
    known to be per sequence or shared."""
    halves = ({}, {})
    for key, value in kwargs.items():
        if value is None or key in SHARED_KWARGS:
            for half in halves:
                half[key] = value
        elif key in SPLIT_KWARGS:
            try:
                for half, r in zip(halves, rows):
                    half[key] = _cut(value, r, batch)
            except LookupError:
                return None
        elif isinstance(value, (bool, int, float, str)):
            for half in halves:
                half[key] = value
        else:
            return None
    for key in CACHE_KWARGS:
        if kwargs.get(key) is not None:
            for half in halves:
                half[key] = _HalfCache(kwargs[key])
    return halves


def cache_of(kwargs: dict):
    """The KV cache among a forward's arguments (None when there is none)."""
    return next((kwargs[k] for k in CACHE_KWARGS if kwargs.get(k) is not None), None)


class Ahead:
    """The next layer's micro-batch A already under way, started by the layer before it while that layer's last
    all-reduce (B's, after its MLP) flew: A's input norm and attention computed, its all-reduce in flight. Taken
    only by a call with the very output tensor and the very argument objects it was started for; else dropped
    (its all-reduce waited, its keys and values never written) and the layer runs from the start."""

    def __init__(self, out: torch.Tensor, kwargs: dict, halves: tuple[dict, dict], flying) -> None:
        self.out, self.kwargs, self.halves, self.flying = out, kwargs, halves, flying

    def matches(self, hidden_states: torch.Tensor, kwargs: dict) -> bool:
        return hidden_states is self.out and kwargs.keys() == self.kwargs.keys() and \
            all(kwargs[k] is self.kwargs[k] for k in kwargs)


def _attention(layer, state, i: int, x: torch.Tensor, norm, half: dict):
    """Micro-batch i's input norm and attention, its all-reduce left in flight."""
    with compute_span(f"{state.name}.attn[{i}]"):
        partial, _ = layer.self_attn(hidden_states=norm(x), **half)
    return start_reduce(partial, state.attn_row.group, f"{state.attn_name}[{i}]", state.config)


def two_batch_layer(layer, state, hidden_states: torch.Tensor, kwargs: dict, norms, nxt=None):
    """One fused decoder layer's prefill as two micro-batches (the module docstring's order); None when its
    arguments do not split (the caller runs one batch). `norms`: the layer's (input, post-attention) norms.
    `nxt`: (the next decoder layer, its state, its input norm) when that layer runs two micro-batches too: its
    micro-batch A is started under this layer's last all-reduce (`Ahead`, kept in the layout under its index)."""
    batch = hidden_states.shape[0]
    a = (batch + 1) // 2
    rows = (slice(0, a), slice(a, batch))
    ahead = state.layout.ahead.pop(state.index, None)
    if ahead is not None and not ahead.matches(hidden_states, kwargs):
        ahead.flying.wait()  # started for other arguments (a hook changed them): dropped
        ahead = None
    halves = ahead.halves if ahead is not None else split_kwargs(kwargs, batch, rows)
    if halves is None or _collecting_attention() or not attention_splits(layer.self_attn):
        if ahead is not None:
            ahead.flying.wait()  # dropped: its keys and values never reach the cache
        return None
    attn_row, mlp_row, config, name = state.attn_row, state.mlp_row, state.config, state.name
    attn_bias, mlp_bias = attn_row.decode_locals()[1], mlp_row.decode_locals()[1]
    flying = [ahead.flying if ahead is not None else None, None]
    for i, r in enumerate(rows):
        if flying[i] is None:
            flying[i] = _attention(layer, state, i, hidden_states[r], norms[0], halves[i])
    _write_cache(cache_of(kwargs), halves)
    residuals = []
    for i, r in enumerate(rows):
        h, residual = add_norm(flying[i].wait(), hidden_states[r], norms[1], bias=attn_bias)
        residuals.append(residual)
        with compute_span(f"{name}.mlp[{i}]"):
            partial = layer.mlp(h)
        flying[i] = start_reduce(partial, mlp_row.group, f"{state.mlp_name}[{i}]", config)
    out = torch.empty_like(hidden_states)
    add_norm(flying[0].wait(), residuals[0], None, bias=mlp_bias, out=out[rows[0]])
    if nxt is not None:  # the next layer's A under B's last all-reduce
        nxt_layer, nxt_state, nxt_norm = nxt
        nxt_halves = split_kwargs(kwargs, batch, rows) if attention_splits(nxt_layer.self_attn) else None
        if nxt_halves is not None:
            state.layout.ahead[nxt_state.index] = Ahead(
                out, kwargs, nxt_halves, _attention(nxt_layer, nxt_state, 0, out[rows[0]], nxt_norm, nxt_halves[0]))
    add_norm(flying[1].wait(), residuals[1], None, bias=mlp_bias, out=out[rows[1]])
    return out


def layer_name(attn_row: str, mlp_row: str) -> str:
    """The decoder layer's path: what its two row layers' paths share ("model.layers.0")."""
    a, b = attn_row.split("."), mlp_row.split(".")
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return ".".join(a[:n]) or "layer"


def _write_cache(cache, halves) -> None:
    """Both halves' keys and values into the real cache, one update in batch order (as one batch stores them)."""
    if cache is None:
        return
    kept = [next(h[k] for k in CACHE_KWARGS if isinstance(h.get(k), _HalfCache)).kept for h in halves]
    if any(k is None for k in kept):  # an attention that did not use the cache: neither half did
        return
    (ka, va, idx, args, kw), (kb, vb, _, _, _) = kept
    cache.update(torch.cat([ka, kb]), torch.cat([va, vb]), idx, *args, **kw)
