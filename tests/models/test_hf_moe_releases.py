"""The plans of an earlier transformers release place the experts too: 5.17 names the experts module
`moe_tp_experts` in its ep_plan (5.25: `ep_dispatch_experts`) and its tp_plan shards each expert's GEMMs over TP
(`packed_colwise` on experts.gate_up_proj, `rowwise` on experts.down_proj, `moe_tp_experts` on the module).

A Qwen3-MoE built here is given 5.17's two plans as they ship (the GPU image runs 5.17): at ep 2 and at
ep 2 x tp 2 its experts are split over the ep ranks (1/ep of them a rank) and the loss and every gradient equal
one process's, as with 5.25's plans. Before, 5.17 refused every MoE family (the tp_plan's parameter entries)
and found no experts in its ep_plan.
"""

import copy

import pytest
import torch

from distributed import distributed

pytest.importorskip("transformers")

import hf_moe_cases  # noqa: E402

TP_PLAN_5_17 = {
    "model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
    "model.layers.*.self_attn.k_norm": "replicated_with_grad_allreduce", "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise", "model.layers.*.mlp.experts.down_proj": "rowwise",
    "model.layers.*.mlp.experts": "moe_tp_experts", "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "colwise_gather_output", "model.embed_tokens": "embedding_rowwise"}
EP_PLAN_5_17 = {"model.layers.*.mlp.gate": "ep_router", "model.layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
                "model.layers.*.mlp.experts.down_proj": "grouped_gemm", "model.layers.*.mlp.experts": "moe_tp_experts"}


def _case(**sizes):
    import warnings

    import overlapkit

    groups = overlapkit.init(**sizes)

    def make(model):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers checks a plan it is handed against this build's modules
            model.tp_plan = dict(TP_PLAN_5_17)
        # 5.25 refuses 5.17's 'ep_router' style when the plan is set: its own attribute, as 5.17 holds it
        model.__dict__["_ep_plan"] = dict(EP_PLAN_5_17)
        return overlapkit.parallelize(model, groups.mesh)
    return hf_moe_cases.errors("qwen3_moe", groups, make=make)


@distributed(world_size=2, timeout_s=90)
def _ep2():
    return _case(ep=2)


@distributed(world_size=4, timeout_s=150)
def _ep2_tp2():
    return _case(ep=2, tp=2)


@pytest.mark.parametrize("sizes", ["ep2", "ep2_tp2"])
def test_transformers_5_17_plans_split_the_experts_exactly(sizes):
    for errs in {"ep2": _ep2, "ep2_tp2": _ep2_tp2}[sizes]():
        assert errs.pop("expert_fraction") == 0.5, errs  # 4 experts over ep 2
        errs.pop("routers_on_slices")
        assert max(errs.values()) < 1e-5, {k: v for k, v in errs.items() if v >= 1e-5}
