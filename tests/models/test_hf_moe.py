"""A transformers MoE model's experts split over ep from its own `base_model_ep_plan`: equal to one process.

`overlapkit.init(ep=..)` then `parallelize(model, groups.mesh)`: every family with an ep_plan
(hf_moe_cases.py) at ep 2, ep 4 and ep 2 x tp 2, the model's own router, top-k weights and aux
loss, each dp rank on its own batch; every gradient (fp32) within 1e-5 of one process, each rank
holding 1/ep of the experts. Asking for an ep the model cannot take fails naming the field.
"""

import pytest

from distributed import distributed

pytest.importorskip("transformers")

import hf_moe_cases  # noqa: E402  (pytest puts this folder on sys.path; spawned ranks inherit it)

TOL = 1e-5


def _run(families, **sizes):
    import overlapkit

    groups = overlapkit.init(**sizes)
    return {family: hf_moe_cases.errors(family, groups) for family in families}


@distributed(world_size=2, timeout_s=300)
def _ep2():
    return _run(hf_moe_cases.MOE_FAMILIES, ep=2)


@distributed(world_size=4, timeout_s=300)
def _ep2_tp2():
    return _run(("qwen2_moe", "qwen3_moe"), ep=2, tp=2)


@distributed(world_size=4, timeout_s=300)
def _ep4():
    return _run(("mixtral",), ep=4)


def _check(per_rank, ep):
    for errs_by_family in per_rank:
        for family, errs in errs_by_family.items():
            assert errs.pop("expert_fraction") == pytest.approx(1 / ep), family
            worst = max(errs, key=errs.get)
            assert errs[worst] <= TOL, (family, worst, errs[worst])


def test_every_family_at_ep2():
    _check(_ep2(), 2)


def test_ep2_with_tp2():
    _check(_ep2_tp2(), 2)


def test_ep4():
    _check(_ep4(), 4)


@distributed(world_size=2, timeout_s=120)
def _refusals():
    import overlapkit
    from transformers import AutoConfig, AutoModelForCausalLM

    groups = overlapkit.init(ep=2)
    out = {}
    try:
        overlapkit.parallelize(hf_moe_cases.build("mixtral", experts=3), groups.mesh)
    except ValueError as e:
        out["indivisible"] = str(e)
    dense = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64))
    try:
        overlapkit.parallelize(dense, groups.mesh)
    except ValueError as e:
        out["no_experts"] = str(e)
    return out


def test_refusals_name_the_field():
    for out in _refusals():
        assert "MixtralConfig.num_local_experts=3" in out["indivisible"] and "ep=2" in out["indivisible"]
        assert "ParallelSizes.ep=2" in out["no_experts"] and "no experts" in out["no_experts"]
