"""A transformers MoE model's experts split over ep from its own `base_model_ep_plan`: equal to one process.

`overlapkit.init(ep=..)` then `parallelize(model, groups.mesh)`: every family with an ep_plan
(hf_moe_cases.py; DeepSeek-V3 and eight more with their attention whole) at ep 2, ep 4, ep 2 x tp 2 and
ep 2 inside dp 4, the model's own router, top-k weights and aux
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
    import overlapkit

    out = {"errors": _run(hf_moe_cases.MOE_FAMILIES, ep=2)}
    # DeepSeek-V3 (its MLA attention's tp_plan styles have no translation) and the further families: the
    # experts over ep, the attention whole (plan={})
    groups = overlapkit.init(ep=2)
    for family in ("deepseek_v3", *hf_moe_cases.MORE_FAMILIES):
        out["errors"][family] = hf_moe_cases.errors(family, groups, plan={})
    out["refusals"] = _refusals()
    return out


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


def _ep2_dp4_clip():
    import torch

    import overlapkit
    from overlapkit.expert_parallel import clip_grad_norm_

    groups = overlapkit.init(ep=2)  # dp 4: two EP groups, each expert held by two ranks
    errs = hf_moe_cases.errors("qwen3_moe", groups)
    # clipping over the dense (tp mesh) and expert (ep mesh) parameters together: the whole model's norm
    ref = hf_moe_cases.build("qwen3_moe")
    model = overlapkit.parallelize(hf_moe_cases.build("qwen3_moe"), groups)
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    model(input_ids=ids, labels=ids).loss.backward()
    ref(input_ids=ids, labels=ids).loss.backward()
    # every rank routed the same batch: expert gradients summed over the EP group (2x), dense ones whole
    for p in model.parameters():
        if not getattr(p, "expert_parallel", False):
            p.grad.to_local().mul_(2)
    total = clip_grad_norm_(model.parameters(), 0.5)
    ref_total = torch.nn.utils.clip_grad_norm_([p for p in ref.parameters()], 0.5 / 2) * 2
    ref_params = dict(ref.named_parameters())
    worst = max(((p.grad.full_tensor() / 2 - ref_params[n].grad).norm() / ref_params[n].grad.norm()).item()
                for n, p in model.named_parameters())
    errs["clip_total"] = abs(total.item() - ref_total.item()) / ref_total.item()
    errs["clipped_grads"] = worst
    return errs


def _dcp_resume(directory: str):
    import torch
    import torch.distributed.checkpoint as dcp

    import overlapkit

    saved = overlapkit.parallelize(hf_moe_cases.build("mixtral", seed=0), overlapkit.init(ep=2, tp=2).mesh)
    dcp.save(saved.state_dict(), checkpoint_id=directory)
    resumed = overlapkit.parallelize(hf_moe_cases.build("mixtral", seed=5), overlapkit.init(ep=4).mesh)
    state = resumed.state_dict()
    dcp.load(state, checkpoint_id=directory)
    resumed.load_state_dict(state)
    want = {n: p.full_tensor() for n, p in saved.named_parameters()}
    got = {n: p.full_tensor() for n, p in resumed.named_parameters()}
    expert = next(p for n, p in resumed.named_parameters() if getattr(p, "expert_parallel", False))
    return {"differs": sorted(n for n in want if not torch.equal(want[n], got[n])),
            "local_experts": expert.to_local().shape[0], "names": sorted(want) == sorted(got)}


@distributed(world_size=4, timeout_s=480)
def _world4(directory: str):
    """One world of 4 for every layout that needs it (CI pays one start-up)."""
    return {"ep2_tp2": (2, _run(("qwen2_moe", "qwen3_moe"), ep=2, tp=2)), "ep4": (4, _run(("mixtral",), ep=4)),
            "ep2_dp4": (2, {"qwen3_moe": _ep2_dp4_clip()}), "dcp": _dcp_resume(directory)}


def _check(errs_by_family, ep):
    for family, errs in errs_by_family.items():
        errs = dict(errs)
        assert errs.pop("expert_fraction") == pytest.approx(1 / ep), family
        errs.pop("routers_on_slices")
        worst = max(errs, key=errs.get)
        assert errs[worst] <= TOL, (family, worst, errs[worst])


def test_every_family_at_ep2_and_refusals():
    for out in _ep2():
        _check(out["errors"], 2)
        refused = out["refusals"]
        assert "MixtralConfig.num_local_experts=3" in refused["indivisible"] and "ep=2" in refused["indivisible"]
        assert "ParallelSizes.ep=2" in refused["no_experts"] and "no experts" in refused["no_experts"]


def test_ep2_x_tp2_ep4_ep2_in_dp4_and_dcp_resume_at_another_layout(tmp_path):
    for out in _world4(str(tmp_path / "ckpt")):
        for case in ("ep2_tp2", "ep4", "ep2_dp4"):
            ep, errs = out[case]
            _check(errs, ep)
        dcp = out["dcp"]
        assert dcp["names"] and dcp["differs"] == [] and dcp["local_experts"] == 1
