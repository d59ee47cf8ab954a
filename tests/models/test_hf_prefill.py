"""A prompt as two micro-batches (`InferenceConfig(prefill="two_batch")`): the plain model's tokens and logits, the
cache it would have stored, the batch really cut in two, and one half's all-reduce in flight under the other's compute.

Tiny random Llama and Qwen3 at tp 2 and 3, greedy `generate()` with HF's dynamic cache, padded and unpadded,
batches of 2, 3 (halves of 2 and 1) and 1 (falls back to one batch); a prompt that splits over tp and one that
does not. The recorder's spans of a prefill show each half's all-reduces (`[0]`, `[1]`) and the first half's
attention all-reduce overlapping the second half's attention.
"""

import copy

import pytest
import torch

from distributed import distributed
from hf_decode_cases import generate as _generate, model as _model, prompts as _prompts

pytest.importorskip("transformers")


def _parallel(ref, mesh, prefill: str):
    import overlapkit
    from overlapkit.inference import InferenceConfig

    return overlapkit.parallelize(copy.deepcopy(ref), mesh, inference=InferenceConfig(prefill=prefill))


def _counting():
    """Count the decoder layers that ran as two micro-batches (this rank's process only)."""
    from overlapkit.models import hf_decode

    ran, layer = [], hf_decode.two_batch_layer

    def counted(*args):
        out = layer(*args)
        ran.append(out is not None)
        return out
    hf_decode.two_batch_layer = counted
    return ran


def _cases(families=("llama", "qwen3")):
    from torch.distributed.device_mesh import init_device_mesh

    tp = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    out, ran = {}, _counting()
    for family in families:
        ref = _model(family, tp)
        model = _parallel(ref, mesh, "two_batch")
        _generate(model, *_prompts(tp, 3, 2, False))  # the first forward checks the layer rule unfused
        for length, batch, padded in ((2 * tp, 3, True), (2 * tp + 1, 2, False), (2 * tp, 1, False),
                                      (2 * tp + 1, 4, True)):
            ids, mask = _prompts(tp, length, batch, padded)
            tokens, logits = _generate(ref, ids, mask)
            got_tokens, got_logits = _generate(model, ids, mask)
            out[(family, length, batch, padded)] = dict(tokens=torch.equal(tokens, got_tokens),
                                                        err=(logits - got_logits).abs().max().item(), ran=sum(ran))
            ran.clear()
    return out


@distributed(world_size=2, timeout_s=90)
def _tp2():
    return _cases()


@distributed(world_size=3, timeout_s=120)
def _tp3():
    return _cases(("llama",))


@pytest.mark.parametrize("tp", [2, 3])
def test_two_micro_batch_prefill_gives_the_plain_models_tokens(tp):
    for rank, out in enumerate({2: _tp2, 3: _tp3}[tp]()):
        for (family, length, batch, padded), r in out.items():
            where = f"tp={tp} rank {rank} {family} prompt {batch}x{length} padded={padded}"
            assert r["tokens"], f"{where}: generated tokens differ from the plain model's"
            assert r["err"] < 1e-5, f"{where}: logits off by {r['err']}"
            # every decoder layer's prefill in two micro-batches (2 layers), except a single sequence's
            assert r["ran"] == (0 if batch == 1 else 2), f"{where}: {r['ran']} layers ran two micro-batches"


@distributed(world_size=2, timeout_s=90)
def _cache_and_spans():
    from overlapkit.runtime.recorder import record
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import DynamicCache

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ref = _model("llama", 2)
    one, two = _parallel(ref, mesh, "decode"), _parallel(ref, mesh, "two_batch")
    ids, mask = _prompts(2, 6, 3, True)
    caches = {}
    with torch.no_grad():
        for name, m in (("ref", ref), ("one", one), ("two", two)):
            m(input_ids=ids, attention_mask=mask)  # the first forward checks the layer rule unfused
            cache = DynamicCache(config=m.config)
            m(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
            caches[name] = [(layer.keys, layer.values) for layer in cache.layers]
    rank, heads = torch.distributed.get_rank(), caches["two"][0][0].shape[1]  # this rank's key/value heads
    local = slice(rank * heads, (rank + 1) * heads)
    err = max((a[:, local] - b).abs().max().item() for name in ("one", "two") for (ka, va), (kb, vb)
              in zip(caches["ref"], caches[name]) for a, b in ((ka, kb), (va, vb)))
    import transformers as T

    torch.manual_seed(0)  # a prompt that takes a while: hidden 256, 3 layers, 4 x 64 tokens
    big = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                                           num_attention_heads=8, num_key_value_heads=2, vocab_size=64,
                                           attn_implementation="sdpa")).eval()
    big_two = _parallel(big, mesh, "two_batch")
    long_ids = torch.randint(1, 64, (4, 64), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        big_two(input_ids=long_ids)
        with record() as rec:
            for _ in range(3):
                rec.next_step()
                big_two(input_ids=long_ids)

    def both(a, b):
        return max(0.0, min(a.end_ms, b.end_ms) - max(a.start_ms, b.start_ms))
    # per forward and layer: A's attention all-reduce beside B's attention, B's beside A's MLP, A's MLP
    # all-reduce beside B's MLP, and (but the last layer) B's MLP all-reduce beside the next layer's A attention
    pairs = [("self_attn.o_proj.fwd[0]", "attn[1]"), ("self_attn.o_proj.fwd[1]", "mlp[0]"),
             ("mlp.down_proj.fwd[0]", "mlp[1]"), ("mlp.down_proj.fwd[1]", "+attn[0]")]
    overlap = {p: 0.0 for p in pairs}
    for step in sorted({s.step for s in rec.spans if s.name == "prefill"}):
        spans = {s.name: s for s in rec.spans if s.step == step}
        for layer in range(3):
            for comm, compute in pairs:
                later = compute.startswith("+")
                if later and layer == 2:
                    continue
                other = f"model.layers.{layer + later}.{compute.lstrip('+')}"
                overlap[(comm, compute)] += both(spans[f"model.layers.{layer}.{comm}"], spans[other])
    names = sorted(n for n in spans if n.startswith("model.layers.0."))
    return dict(cache_err=err, names=names, overlap=overlap, shapes=[k.shape for k, _ in caches["two"]])


def test_two_micro_batches_store_the_one_batch_cache_and_overlap_an_all_reduce():
    for r in _cache_and_spans():
        assert r["cache_err"] < 1e-5 and r["shapes"][0][0] == 3, r
        halves = {"model.layers.0.self_attn.o_proj.fwd[0]", "model.layers.0.self_attn.o_proj.fwd[1]",
                  "model.layers.0.mlp.down_proj.fwd[0]", "model.layers.0.mlp.down_proj.fwd[1]",
                  "model.layers.0.attn[0]", "model.layers.0.attn[1]"}
        assert halves <= set(r["names"]), r["names"]
        # over three prefills, each of a layer's four all-reduces was in flight while the other half computed
        assert all(ms > 0 for ms in r["overlap"].values()), r["overlap"]


@distributed(world_size=2, timeout_s=90)
def _hooked():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ref = _model("llama", 2)
    model = _parallel(ref, mesh, "two_batch")
    ids, mask = _prompts(2, 5, 3, True)
    _generate(model, ids, mask)
    for m in (ref, model):  # a hook hands layer 1 another tensor: the first half started ahead for it is dropped
        m.model.layers[1].register_forward_pre_hook(lambda _m, args: (args[0] * 2.0, *args[1:]))
    tokens, logits = _generate(ref, ids, mask)
    got, got_logits = _generate(model, ids, mask)
    return torch.equal(tokens, got), (logits - got_logits).abs().max().item()


def test_a_hook_between_layers_drops_the_half_started_ahead_and_stays_exact():
    for same, err in _hooked():
        assert same and err < 1e-5, (same, err)


def test_the_prefill_setting_is_checked():
    from overlapkit.inference import InferenceConfig

    with pytest.raises(ValueError, match="InferenceConfig.prefill='halves' must be one of"):
        InferenceConfig(prefill="halves")


def test_only_attentions_that_reach_the_cache_by_update_alone_are_split():
    # the half batch's stand-in cache answers `update` and passes the rest on; an attention that tests the cache's
    # type or reaches into it (an encoder-decoder cache's self/cross parts) runs one batch
    from overlapkit.models.hf_prefill import attention_splits
    from transformers.models.bart.modeling_bart import BartAttention
    from transformers.models.llama.modeling_llama import LlamaAttention
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    assert attention_splits(object.__new__(LlamaAttention)) and attention_splits(object.__new__(Qwen3Attention))
    assert not attention_splits(object.__new__(BartAttention))
