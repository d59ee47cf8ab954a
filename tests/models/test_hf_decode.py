"""Decode at TP: HF's own `generate()` on a parallelized model runs the inference layout and gives the plain model's tokens.

Tiny random Llama and Qwen3, greedy decoding with the KV cache, batched prompts of different lengths
(left padding) and without padding, a prompt that splits over the ranks (sequence-parallel prefill
through the training layers) and one that does not (prefill in the decode layout), at tp 2, 3 and 4:
the tokens equal the unsharded model's and every step's logits match it (fp32, 1e-5). Every decoder
layer is fused (one all-reduce + residual add + norm per row layer); a layer whose attention does not
return its row layer's output as it is stays unfused and still exact. The recorder sees one prefill
step and one step per generated token, each decode step with exactly 2 collectives per layer plus the
embedding's all-reduce and the logits' all-gather, and reports its exposed communication.
"""

import copy

import pytest
import torch

from distributed import distributed
from hf_decode_cases import NEW, generate as _generate, model as _model, prompts as _prompts

pytest.importorskip("transformers")


def _cases(families):
    import overlapkit
    from torch.distributed.device_mesh import init_device_mesh

    tp = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    out = {}
    for family in families:
        ref = _model(family, tp)
        model = overlapkit.parallelize(copy.deepcopy(ref), mesh)
        # a prompt that splits over tp (prefill sequence parallel) and one that does not
        for length, batch, padded in ((2 * tp, 3, True), (2 * tp + 1, 2, False), (2 * tp + 1, 3, True)):
            ids, mask = _prompts(tp, length, batch, padded)
            tokens, logits = _generate(ref, ids, mask)
            got_tokens, got_logits = _generate(model, ids, mask)
            out[(family, length, batch, padded)] = dict(
                tokens=torch.equal(tokens, got_tokens), err=(logits - got_logits).abs().max().item(),
                fused=[(layer.self_attn.o_proj.fused_reduce, layer.mlp.down_proj.fused_reduce)
                       for layer in model.model.layers])
    return out


@distributed(world_size=2)
def _tp2():
    return _cases(("llama", "qwen3"))


@distributed(world_size=3, timeout_s=90)
def _tp3():
    return _cases(("llama", "qwen3"))


@distributed(world_size=4, timeout_s=120)
def _tp4():
    return _cases(("llama", "qwen3"))


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_generate_in_the_decode_layout_gives_the_plain_models_tokens(tp):
    results = {2: _tp2, 3: _tp3, 4: _tp4}[tp]()
    for rank, out in enumerate(results):
        for (family, length, batch, padded), r in out.items():
            where = f"tp={tp} rank {rank} {family} prompt {batch}x{length} padded={padded}"
            assert r["tokens"], f"{where}: generated tokens differ from the plain model's"
            assert r["err"] < 1e-5, f"{where}: logits off by {r['err']}"
            assert all(a and b for a, b in r["fused"]), f"{where}: a decoder layer was left unfused: {r['fused']}"


@distributed(world_size=2)
def _unfusable():
    import overlapkit
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ref = _model("llama", 2)
    model = overlapkit.parallelize(copy.deepcopy(ref), mesh)
    # The attention no longer returns its row layer's output as it is: fusing its all-reduce would be wrong.
    model.model.layers[1].self_attn.register_forward_hook(lambda _m, _a, out: (out[0] * 1.0, out[1]))
    ref.model.layers[1].self_attn.register_forward_hook(lambda _m, _a, out: (out[0] * 1.0, out[1]))
    ids, mask = _prompts(2, 5, 2, True)
    tokens, logits = _generate(ref, ids, mask)
    got_tokens, got_logits = _generate(model, ids, mask)
    return dict(tokens=torch.equal(tokens, got_tokens), err=(logits - got_logits).abs().max().item(),
                fused=[layer.self_attn.o_proj.fused_reduce for layer in model.model.layers])


def test_a_layer_outside_the_rule_stays_unfused_and_exact():
    for r in _unfusable():
        assert r["tokens"] and r["err"] < 1e-5, r
        assert r["fused"] == [True, False], r


@distributed(world_size=2)
def _recorded():
    import overlapkit
    from overlapkit.inference import exposed_per_step
    from overlapkit.runtime.recorder import record
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = overlapkit.parallelize(_model("llama", 2), mesh)
    ids, mask = _prompts(2, 4, 2, True)
    _generate(model, ids, mask)  # the first decode forward checks the rule unfused
    with record() as rec:
        _generate(model, ids, mask)
    steps = exposed_per_step(rec.spans)
    kinds = {s.step: sorted({(x.kind) for x in rec.spans if x.step == s.step and x.is_comm}) for s in rec.spans
             if s.is_compute and s.name == "decode"}
    return steps, kinds


def test_the_recorder_reports_exposed_communication_per_prefill_and_decode_step():
    for steps, kinds in _recorded():
        assert [s["kind"] for s in steps] == ["prefill"] + ["decode"] * (NEW - 1), steps
        for s in steps[1:]:
            # per decode step: the embedding's all-reduce, one fused all-reduce per row layer (2 per decoder
            # layer, 2 layers), the logits' all-gather; nothing gathers or scatters the sequence
            assert s["comm_spans"] == 1 + 2 * 2 + 1, s
            assert 0 < s["exposed_ms"] <= s["comm_ms"] + 1e-9 and s["comm_ms"] <= s["step_ms"] + 1e-6, s
        assert steps[0]["comm_spans"] > steps[1]["comm_spans"], steps  # prefill: the sequence-parallel path
        for step, ks in kinds.items():
            assert ks == ["tp_all_gather", "tp_all_reduce"], (step, ks)


def test_the_pre_norm_rule_reads_the_layer_source():
    import transformers as T
    from overlapkit.models.hf_decode import pre_norm_rule

    assert pre_norm_rule(_model("llama", 1).model.layers[0]) == ""
    assert pre_norm_rule(_model("qwen3", 1).model.layers[0]) == ""
    cfg = T.Gemma2Config(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8, vocab_size=32)
    why = pre_norm_rule(T.Gemma2ForCausalLM(cfg).model.layers[0])
    assert "not the pre-norm block" in why, why
    assert "has no" in pre_norm_rule(torch.nn.Linear(2, 2))


def _stale_flag_and_one_rank():
    import overlapkit
    from torch.distributed.device_mesh import init_device_mesh

    tp = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    ref = _model("llama", tp)
    fresh = overlapkit.parallelize(copy.deepcopy(ref), mesh)
    used = overlapkit.parallelize(copy.deepcopy(ref), mesh)
    ids, mask = _prompts(tp, 2 * tp + 1, 2, True)
    tokens, _ = _generate(ref, ids, mask)
    got, _ = _generate(used, ids, mask)  # leaves the decode flag set after its last step
    grads = []
    for model in (fresh, used):  # the base model called directly: the top-level hook that resets the flag is skipped
        model.model(input_ids=ids[:, :2 * tp]).last_hidden_state.square().sum().backward()
        grads.append({n: getattr(p.grad, "to_local", lambda g=p.grad: g)().clone() for n, p in model.named_parameters()
                      if p.grad is not None})  # tp 1 keeps plain parameters
    same = grads[0].keys() == grads[1].keys() and all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])
    # converted after its first decode steps: the decode layout reads the parameters' new tensors
    ref64, used64 = ref.to(torch.float64), used.to(torch.float64)
    converted = torch.equal(_generate(ref64, ids, mask)[0], _generate(used64, ids, mask)[0])
    return dict(tokens=torch.equal(tokens, got), grads_equal=same, n=len(grads[0]), converted=converted)


@distributed(world_size=1)
def _one_rank():
    return _stale_flag_and_one_rank()


@distributed(world_size=2)
def _two_ranks():
    return _stale_flag_and_one_rank()


@pytest.mark.parametrize("tp", [1, 2])
def test_one_rank_decodes_exactly_a_later_forward_with_gradients_ignores_the_decode_flag_and_to_is_seen(tp):
    for r in (_one_rank if tp == 1 else _two_ranks)():
        assert r["tokens"], r
        assert r["grads_equal"] and r["n"] > 0 and r["converted"], r


@distributed(world_size=2)
def _positional():
    import overlapkit
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ref = _model("llama", 2)
    model = overlapkit.parallelize(copy.deepcopy(ref), mesh)
    ids, mask = _prompts(2, 5, 2, True)
    _generate(model, ids, mask)  # every layer verified and fused
    out = {}
    for name, m in (("ref", ref), ("ok", model)):
        layer = m.model.layers[0]
        h = torch.randn(2, 1, 32, generator=torch.Generator().manual_seed(5))
        cos_sin = m.model.rotary_emb(h, torch.zeros(2, 1, dtype=torch.long))
        with torch.no_grad():
            m(input_ids=ids[:, :1])  # sets the layout for a one-token forward (decode on the parallel model)
            out[name] = layer(h, None, None, None, False, cos_sin)  # attention_mask, ids, cache, use_cache, cos/sin
    return (out["ok"] - out["ref"]).abs().max().item()


def test_a_layer_called_with_positional_arguments_is_still_exact():
    for err in _positional():
        assert err < 1e-5, err
