"""Decode at TP for a transformers decoder: one fused all-reduce + residual add + norm per row layer.

What overlaps what: nothing can hide a decode step's all-reduce (the next GEMM needs its sum), so
this path makes each one the only thing between two GEMMs. `prepare_decode` (installed by
`overlapkit.parallelize` on a transformers model) picks, per forward under no_grad, the layout:

- **prefill** of a prompt that splits over the TP ranks: the training layers' sequence-parallel
  path (all-gather+GEMM / GEMM+reduce-scatter, pipelined as `overlap` says);
- **decode** (a step's tokens do not split, or TP is 1, or the plan has no sequence parallelism):
  each column layer one GEMM on its shard with no communication, and each decoder layer that
  follows the pre-norm rule below runs `inference.all_reduce_add_norm` after its attention and its
  MLP: the row layer's partial sums reduced once, then the bias, the residual add and the next norm
  (the layer's post-attention norm, or the next layer's input norm, handed over by identity).

The rule, read from the layer class's source (not its name): the forward is exactly HF's pre-norm
block `residual = h; h = input_norm(h); h, _ = self_attn(hidden_states=h, <its arguments>);
h = residual + h; residual = h; h = post_norm(h); h = mlp(h); return residual + h`, and the
attention and the MLP each hold one row-parallel layer whose output they return as it is (checked
on the first decode forward, which runs unfused). A layer outside the rule runs the layers' own
decode path (each row layer all-reduces by itself): exact, only not fused.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

import torch
from torch import nn

from ..inference.fused import InferenceConfig, all_reduce_add_norm
from ..inference.steps import begin_step, end_step
from ..runtime import recorder
from ..runtime.agreement import agree
from ..tensor_parallel.layers import RowParallelLinear
from ..tensor_parallel.linear_base import local_of
from ..tensor_parallel.region import region_of
from .hf_prefill import cache_of, eligible, layer_name, two_batch_layer

PRE_NORM = """
residual = hidden_states
hidden_states = self.input_layernorm(hidden_states)
hidden_states, _ = self.self_attn()
hidden_states = residual + hidden_states
residual = hidden_states
hidden_states = self.post_attention_layernorm(hidden_states)
hidden_states = self.mlp(hidden_states)
hidden_states = residual + hidden_states
return hidden_states
"""
"""The decoder layer forward the fused path reproduces (the attention call's arguments checked apart)."""


def _statements(body: list) -> list[str]:
    out = []
    for stmt in body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # a docstring
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call) and \
                ast.unparse(stmt.value.func) == "self.self_attn":
            out.append(f"{ast.unparse(stmt.targets[0])} = self.self_attn()")
            continue
        out.append(ast.unparse(stmt))
    return out


def pre_norm_rule(layer: nn.Module) -> str:
    """'' when `layer`'s forward is the pre-norm block the fused path reproduces, else why not."""
    name = type(layer).__name__
    missing = [a for a in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
               if not isinstance(getattr(layer, a, None), nn.Module)]
    if missing:
        return f"{name} has no {missing}"
    fn = inspect.unwrap(type(layer).forward)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError) as e:
        return f"the source of {name}.forward cannot be read ({e})"
    func = tree.body[0]
    if _statements(func.body) != _statements(ast.parse(PRE_NORM).body):
        return f"{name}.forward is not the pre-norm block (residual, norm, attention, add, norm, MLP, add)"
    call = next(s.value for s in func.body if isinstance(s, ast.Assign) and isinstance(s.value, ast.Call)
                and ast.unparse(s.value.func) == "self.self_attn")
    params = [a.arg for a in func.args.args[2:]]  # after self, hidden_states
    passed = {k.arg: ast.unparse(k.value) for k in call.keywords}
    var_kw = func.args.kwarg.arg if func.args.kwarg else None
    expected = {"hidden_states": "hidden_states", **{p: p for p in params}, None: var_kw}
    if call.args or passed != {k: v for k, v in expected.items() if v is not None}:
        return f"{name}.forward does not hand the attention its own arguments unchanged"
    return ""


class _Layout:
    """What the model's forward pre-hook decided for this forward, read by its fused layers, and the recorder
    step it opened (closed by its forward hook)."""

    stack = None
    two_batch = False
    """This forward is a prompt run as two micro-batches (InferenceConfig.prefill="two_batch", hf_prefill.py)."""

    def __init__(self) -> None:
        self.ahead: dict = {}
        """Layer index -> its first micro-batch started by the layer before (hf_prefill.Ahead), in a two-batch
        prefill; what a forward that raised left here is dropped by the next forward."""


class _LayerState:
    """One decoder layer's fused path: its two row layers, the norm after it, and what it hands over."""

    def __init__(self, layer: nn.Module, attn_row, mlp_row, original, config: InferenceConfig, index: int,
                 layout: _Layout):
        self.attn_row, self.mlp_row, self.original = attn_row, mlp_row, original
        self.next_norm: nn.Module | None = None
        self.next: _LayerState | None = None
        self.handed: tuple | None = None
        """(h, norm(h)) computed by the previous layer's fused op for this layer's input norm."""
        self.next_layer: nn.Module | None = None
        self.verified: bool | None = None
        self.config, self.index, self.layout = config, index, layout
        self.attn_name, self.mlp_name = attn_row.name + ".fwd", mlp_row.name + ".fwd"
        self.name = layer_name(attn_row.name, mlp_row.name)
        sig = inspect.signature(inspect.unwrap(type(layer).forward))
        params = list(sig.parameters.values())[2:]  # after self and the activation
        self.defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        self.names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called", "_backward_hooks", "_backward_pre_hooks")


def _norm_now(norm: nn.Module) -> nn.Module:
    """The norm to call in the decode layout: a twin computing on its parameters' local tensors without
    hooks, when the only hooks on it are overlapkit's own (the replicated parameters' local views, which
    the twin has already); else the norm itself (a user's hook on it still runs). Rebuilt whenever a
    parameter object or the hooks change."""
    params = norm._parameters
    held = norm.__dict__.get("_overlapkit_decode_twin")
    hooks = (len(norm._forward_pre_hooks), len(norm._forward_hooks))  # every forward hook is in one of these
    if held is not None and held[1] == hooks and all(held[0].get(k) is local_of(v) for k, v in params.items()):
        return held[2]
    ours = all(getattr(fn, "__module__", "").startswith("overlapkit.") or
               getattr(getattr(fn, "func", None), "__module__", "").startswith("overlapkit.")
               for d in ("_forward_pre_hooks", "_forward_hooks") for fn in getattr(norm, d).values())
    twin = norm
    if ours:
        twin = object.__new__(type(norm))
        twin.__dict__.update({k: v for k, v in norm.__dict__.items() if k != "_overlapkit_decode_twin"})
        twin.__dict__["_parameters"] = {k: local_of(v) for k, v in params.items()}
        for d in _HOOK_DICTS:
            if d in twin.__dict__:
                twin.__dict__[d] = type(twin.__dict__[d])()
    norm.__dict__["_overlapkit_decode_twin"] = ({k: local_of(v) for k, v in params.items()}, hooks, twin)
    return twin


def _row_layer(block: nn.Module) -> RowParallelLinear | None:
    rows = [m for m in block.modules() if isinstance(m, RowParallelLinear)]
    return rows[0] if len(rows) == 1 and rows[0].input_is_parallel else None


def _fused_forward(layer: nn.Module, state: _LayerState, hidden_states: torch.Tensor, *args, **kwargs):
    region = region_of(layer)
    if torch.is_grad_enabled() or region is None or not region.decode:
        state.handed = None  # the row layers take their training path: they reduce by themselves
        return state.original(hidden_states, *args, **kwargs)
    if args:  # positional arguments after the activation: by their names in the layer's signature
        if len(args) > len(state.names) or any(n in kwargs for n in state.names[:len(args)]):
            raise TypeError(f"{type(layer).__name__}.forward: cannot bind {len(args)} positional arguments to "
                            f"{state.names}")
        kwargs = {**dict(zip(state.names, args)), **kwargs}
    kwargs = {**state.defaults, **kwargs}
    handed, state.handed = state.handed, None
    if not state.verified:
        return _checked_forward(layer, state, hidden_states, kwargs)
    if state.layout.two_batch:
        nxt = state.next
        out = two_batch_layer(layer, state, hidden_states, kwargs,
                              (_norm_now(layer.input_layernorm), _norm_now(layer.post_attention_layernorm)),
                              (state.next_layer, nxt, _norm_now(state.next_norm)) if nxt and nxt.verified and
                              nxt.index == state.index + 1 else None)  # the layer the model calls next
        if out is not None:
            return out
    residual = hidden_states
    h = handed[1] if handed is not None and handed[0] is hidden_states else \
        _norm_now(layer.input_layernorm)(hidden_states)
    partial, _ = layer.self_attn(hidden_states=h, **kwargs)
    row = state.attn_row
    h, residual = all_reduce_add_norm(partial, residual, _norm_now(layer.post_attention_layernorm), row.group,
                                      bias=row.decode_locals()[1], name=state.attn_name, config=state.config)
    partial = layer.mlp(h)
    row = state.mlp_row
    normed, out = all_reduce_add_norm(partial, residual, _norm_now(state.next_norm) if state.next_norm else None,
                                      row.group, bias=row.decode_locals()[1], name=state.mlp_name, config=state.config)
    if state.next is not None and normed is not None:
        state.next.handed = (out, normed)
    return out


def _checked_forward(layer: nn.Module, state: _LayerState, hidden_states: torch.Tensor, kwargs: dict):
    """The first decode forward: the block run unfused (each row layer reduces itself), checking that
    the attention and the MLP return their row layer's output as it is; from then on, fused."""
    seen = {}

    def keep(name, _module, _args, out):
        seen[name] = out

    hooks = [state.attn_row.register_forward_hook(functools.partial(keep, "attn")),
             state.mlp_row.register_forward_hook(functools.partial(keep, "mlp"))]
    try:
        residual = hidden_states
        attn, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden_states), **kwargs)
        h = residual + attn
        mlp = layer.mlp(layer.post_attention_layernorm(h))
        out = h + mlp
    finally:
        for hook in hooks:
            hook.remove()
    ok = attn is seen.get("attn") and mlp is seen.get("mlp")
    agree(state.attn_row.group, "prepare_decode", layer=state.index, returns_row_output=ok)
    state.verified = ok
    if ok:
        state.attn_row.fused_reduce = state.mlp_row.fused_reduce = True
    else:  # the layer stays on the unfused decode path: exact
        layer.forward = state.original
    return out


def prepare_decode(model: nn.Module, tp: int, *, sequence_parallel: bool,
                   config: InferenceConfig | None = None) -> int:
    """Install the inference layout on a parallelized transformers model; the number of decoder layers fused.

    A forward pre-hook decides each forward: under no_grad and without labels, a sequence that does not
    split over `tp` (a decode step), any sequence at tp 1 or without `sequence_parallel`, runs the decode
    layout; a prompt that splits runs the training layers' sequence-parallel prefill. The same hooks open
    the recorder's prefill / decode step (inference/steps.py).
    """
    config = config or InferenceConfig()
    layout = _Layout()
    region = region_of(model)
    if region is None:
        raise ValueError("prepare_decode: the model has no sequence region; call overlapkit.parallelize first")
    # At tp 1 there is nothing to reduce: the fused op would be the layer's own add + norm behind more
    # Python (1.10x plain decode ms/token on a host-bound model), so the layers keep their own forward.
    layers = [m for m in model.modules() if not pre_norm_rule(m)] if tp > 1 else []
    states = []
    for i, layer in enumerate(layers):
        attn_row, mlp_row = _row_layer(layer.self_attn), _row_layer(layer.mlp)
        if attn_row is None or mlp_row is None:
            continue
        state = _LayerState(layer, attn_row, mlp_row, layer.forward, config, i, layout)
        layer.forward = functools.partial(_fused_forward, layer, state)
        states.append((layer, state))
    for (_, state), (nxt_layer, nxt) in zip(states, states[1:]):
        state.next, state.next_norm, state.next_layer = nxt, nxt_layer.input_layernorm, nxt_layer
    model.register_forward_pre_hook(functools.partial(_choose_layout, region, layout, tp, sequence_parallel,
                                                      config.prefill), with_kwargs=True)
    model.register_forward_hook(functools.partial(_close_step, layout), always_call=True)
    return len(states)


def _batch_and_length(args, kwargs) -> tuple[int, int | None]:
    x = kwargs.get("input_ids")
    if x is None:
        x = kwargs.get("inputs_embeds")
    if x is None and args and isinstance(args[0], torch.Tensor):
        x = args[0]
    return (x.shape[0], x.shape[1]) if x is not None and x.dim() >= 2 else (0, None)


def _past_length(kwargs) -> int:
    length = getattr(cache_of(kwargs), "get_seq_length", None)
    return int(length()) if length is not None else 0


def _choose_layout(region, layout: _Layout, tp: int, sequence_parallel: bool, prefill: str, _module, args, kwargs):
    batch, seq = _batch_and_length(args, kwargs)
    inferring = not torch.is_grad_enabled() and kwargs.get("labels") is None
    # two micro-batches only where there is a reduce to hide (tp > 1) and the layers run the decode layout
    layout.two_batch = inferring and seq is not None and tp > 1 and prefill == "two_batch" and \
        eligible(batch, seq, cache_of(kwargs))
    split_prompt = sequence_parallel and prefill != "decode" and not layout.two_batch
    region.decode = inferring and seq is not None and (tp == 1 or not split_prompt or seq % tp != 0)
    layout.ahead.clear()  # a first micro-batch started ahead in a forward that raised: not this forward's
    end_step(layout.stack)  # a forward that raised before its hook closed it
    layout.stack = None
    if inferring and (recorder.active() is not None or recorder.profiling()):
        layout.stack = begin_step("decode" if seq == 1 and _past_length(kwargs) > 0 else "prefill")


def _close_step(layout: _Layout, _module, _args, _out):
    end_step(layout.stack)
    layout.stack = None
