"""transformers' own tp_plan translated into overlapkit's styles: every family that ships one equals the unsharded model.

Each family builds from a tiny config (hf_families.py); `overlapkit.parallelize(model, mesh)`
with no plan reads `model.tp_plan`. The loss is HF's own `labels=` loss (swapped for the
vocabulary-parallel one), every gradient is compared with the reference's slice (fp32, 1e-5),
with sequence parallelism on where the family allows it (all of these) and off.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed import distributed

pytest.importorskip("transformers")

import hf_families  # noqa: E402  (pytest puts this folder on sys.path; spawned ranks inherit it)


def _rel(a, b) -> float:
    # Floor 1e-3: a key projection's bias has a gradient of ~1e-7 (softmax ignores a shift of
    # every key by one vector), whose relative error is rounding noise; real gradients are >1e-2.
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-3)).item()


def _errors(ref, model, tp: int) -> dict:
    from overlapkit.models import expected_local

    ids = torch.randint(0, ref.config.vocab_size, (2, 4 * tp), generator=torch.Generator().manual_seed(1))
    ids[0, :2] = ref.config.pad_token_id  # the padding row's gradient stays zero on both sides
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    r = ref(input_ids=ids, labels=ids)
    r.loss.backward()
    errs = {"loss": abs(out.loss.item() - r.loss.item()) / abs(r.loss.item()),
            "logits": _rel(out.logits.to_local(), r.logits.chunk(tp, -1)[dist.get_rank()])}
    for name, local, full in expected_local(model, ref, "grad"):
        errs[name] = _rel(local, full)
    errs["parameters"] = float(len(list(model.parameters())) != len(list(ref.parameters())))
    return errs


def _family_cases(families, sps, overlap: str = "bulk") -> dict:
    import overlapkit
    from overlapkit.models import translate_hf_plan
    from overlapkit.tensor_parallel import ScatterSequence
    from torch.distributed.device_mesh import init_device_mesh

    tp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    out = {}
    for family in families:
        for sp in sps:
            ref = hf_families.build(family, tp)
            plan = translate_hf_plan(ref, tp, overlap=overlap, sequence_parallel=sp)
            errs = _errors(ref, overlapkit.parallelize(copy.deepcopy(ref), mesh, overlap=overlap,
                                                       sequence_parallel=sp), tp)
            errs["sp_on"] = float(any(isinstance(s, ScatterSequence) for s in plan.values()))
            out[(family, sp, overlap)] = errs
    return out


@distributed(world_size=2, timeout_s=240)
def _tp2():
    out = _family_cases(hf_families.FAMILIES, (None,))
    out.update(_family_cases(("qwen2", "phi3", "gpt_neox"), (False,)))
    out.update(_family_cases(("qwen2", "phi3", "gemma"), (None,), overlap="pipelined"))
    return out


@distributed(world_size=3, timeout_s=240)
def _tp3():
    return _family_cases(("llama", "qwen2", "gemma", "qwen3", "phi3", "olmo2", "gpt_neox"), (None,))


def _check(per_rank):
    for case, errs in per_rank.items():
        sp_on = errs.pop("sp_on")
        assert sp_on == (case[1] is not False), case  # SP on wherever it was not turned off
        for key, err in errs.items():
            assert err <= 1e-5, (case, key, err)


@pytest.mark.parametrize("run", [_tp2, _tp3], ids=["tp2", "tp3"])
def test_every_family_with_a_tp_plan_matches_unsharded(run):
    for per_rank in run():
        _check(per_rank)


def test_translated_llama_plan_is_the_built_in_one():
    from overlapkit.models import llama_plan, translate_hf_plan

    model = hf_families.build("llama", 2)
    for sp in (True, False):
        built_in = {k: repr(v) for k, v in llama_plan(model, 2, overlap="pipelined", sequence_parallel=sp).items()}
        translated = {k: repr(v) for k, v in
                      translate_hf_plan(model, 2, overlap="pipelined", sequence_parallel=sp).items()}
        assert translated == built_in


def test_what_the_translation_cannot_express_is_refused_naming_the_module():
    from transformers import AutoConfig, AutoModelForCausalLM

    from overlapkit.models import translate_hf_plan
    from overlapkit.tensor_parallel import ScatterSequence

    # A MoE family. transformers 5.24's plan shards the experts' fused projections (no overlapkit
    # style): refused, naming them. Later ones name only the attention and dense-MLP paths the MoE
    # block lacks: the experts stay whole (their gradient complete), and under SP the MoE block routes
    # this rank's slice of the sequence, its router's logits gathered for the aux loss (hf_moe_sp.py).
    moe = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "qwen2_moe", hidden_size=32, intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=64, num_experts=4,
        num_experts_per_tok=2))
    if any("experts" in k for k in moe.tp_plan):
        with pytest.raises(ValueError, match=r"model\.layers\.[0*]\.mlp\.experts.*pass plan="):
            translate_hf_plan(moe, 2, overlap="none", sequence_parallel=None)
    else:
        from overlapkit.models.hf_moe_sp import MoEBlockSequenceParallel

        plan = translate_hf_plan(moe, 2, overlap="none", sequence_parallel=None)
        assert any(isinstance(s, ScatterSequence) for s in plan.values()), plan
        assert repr(plan["model.layers.*.mlp"]) == repr(MoEBlockSequenceParallel(router="gate", experts="experts"))
        assert not any(k.startswith("model.layers.*.mlp.experts") or k == "model.layers.*.mlp.gate" for k in plan)
        assert repr(plan["model.layers.*.mlp.shared_expert_gate"]) == "SequenceParallel()"
    # A family without a plan.
    stablelm = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "stablelm", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=64))
    with pytest.raises(ValueError, match="StableLmForCausalLM has no tensor-parallel plan.*plan="):
        translate_hf_plan(stablelm, 2, overlap="none", sequence_parallel=None)
    # (Parameters between column and row layers the plan does not mention, such as Cohere's
    # per-head q/k norms, are decided from the forward: tests/models/test_plan_edges.py, test_hf_sweep.py.)
    # Sizes that do not split name the config field.
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by the tensor-parallel size 4"):
        translate_hf_plan(hf_families.build("qwen2", 2), 4, overlap="none", sequence_parallel=None)


def test_sequence_parallel_steps_aside_for_a_module_that_is_not_per_token():
    from overlapkit.models import translate_hf_plan
    from overlapkit.tensor_parallel import ScatterSequence

    model = hf_families.build("llama", 2)
    model.model.layers[1].mixer = nn.Conv1d(8, 8, 3)  # mixes neighbouring tokens: not on a slice of the sequence
    with pytest.raises(ValueError, match=r"sequence_parallel=True: model\.layers\.1\.mixer \(Conv1d\)"):
        translate_hf_plan(model, 2, overlap="none", sequence_parallel=True)
    plan = translate_hf_plan(model, 2, overlap="none", sequence_parallel=None)
    assert not any(isinstance(s, ScatterSequence) for s in plan.values())


def test_hf_tp_plan_reads_the_merged_plan_or_builds_it_from_the_config():
    from types import SimpleNamespace

    from overlapkit.models import hf_tp_plan

    model = hf_families.build("llama", 2)
    plan = hf_tp_plan(model)
    assert plan["lm_head"] in ("colwise_rep", "colwise_gather_output")
    assert plan["model.layers.*.self_attn.o_proj"] == "rowwise"

    class Old(nn.Module):  # a release without `tp_plan`: the config's plan under the base model, then the head's
        base_model_prefix = "model"
        _tp_plan = {"lm_head": "colwise_rep"}

        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.config = SimpleNamespace(base_model_tp_plan={"layers.*.mlp.up_proj": "colwise"})

    assert hf_tp_plan(Old()) == {"model.layers.*.mlp.up_proj": "colwise", "lm_head": "colwise_rep"}
