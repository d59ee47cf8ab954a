"""Tiny MoE configs of the transformers families with a `base_model_ep_plan`, and the check of one against one process."""

import copy

import torch
import torch.distributed as dist

MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "gpt_oss")
"""model_type of every MoE family tested (each ships an ep_plan whose experts hold stacked gate_up_proj/down_proj)."""
MORE_FAMILIES = ("granitemoe", "granitemoeshared", "glm4_moe", "hunyuan_v1_moe", "flex_olmo", "minimax", "exaone_moe",
                 "cohere2_moe")
"""Further families with an ep_plan, built from one generic config and checked with their attention whole (plan={})."""


def config(family: str, experts: int = 4, **extra):
    """A 2-layer config, 4 heads of 8 (2 KV heads), `experts` routed experts of width 16, top-2, aux loss on."""
    from transformers import AutoConfig

    kw = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, vocab_size=64, max_position_embeddings=64, pad_token_id=1, bos_token_id=0, eos_token_id=2,
              attn_implementation="eager", output_router_logits=True, router_aux_loss_coef=0.1, num_experts_per_tok=2)
    if family in MORE_FAMILIES:  # every name a family may read its expert count and width from
        kw.update(num_experts=experts, num_local_experts=experts, n_routed_experts=experts, moe_intermediate_size=16,
                  first_k_dense_replace=0, n_group=1, topk_group=1)
        kw.pop("output_router_logits")
        kw.pop("router_aux_loss_coef")
        return AutoConfig.for_model(family, **kw, **extra)
    if family == "deepseek_v3":  # MLA attention, a shared expert, group-limited top-k
        kw.update(n_routed_experts=experts, moe_intermediate_size=16, first_k_dense_replace=0, n_group=1, topk_group=1,
                  q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                  n_shared_experts=1, num_key_value_heads=4)
        kw.pop("output_router_logits")
        kw.pop("router_aux_loss_coef")
    elif family in ("mixtral", "gpt_oss"):
        kw.update(num_local_experts=experts)
    else:
        kw.update(num_experts=experts)
    if family in ("qwen2_moe", "qwen3_moe"):
        kw.update(moe_intermediate_size=16)
    if family == "qwen2_moe":
        kw.update(shared_expert_intermediate_size=16)
    if family == "olmoe":
        kw.update(intermediate_size=16)
    kw.update(extra)
    return AutoConfig.for_model(family, **kw)


def build(family: str, seed: int = 0, **extra):
    """The model in fp32, its routers and experts drawn wide enough that routing differs token to token."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(family, **extra)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name or "gate" in name:
                p.normal_(0, 0.2)
    return model


def errors(family: str, groups, plan: dict | None = None, options: dict | None = None, mask: bool = False,
           make=None, **extra) -> dict:
    """Relative errors of the loss and every gradient against one process, each rank of dp on its own
    batch, the gradients averaged over dp (`average_data_parallel_grads`); also each rank's expert memory
    as a fraction of the whole experts. `plan={}`: attention left whole (a family whose tp_plan has no
    translation); `routers_on_slices`: how many routers ran on a slice of the sequence. `options`: parallelize's keywords (sequence_parallel=, overlap=); `mask`: an attention
    mask with padding on the left of some rows (the aux loss counts only the tokens it keeps); `make`: how
    the model is parallelized instead (the unsharded copy in, the parallel model out)."""
    import overlapkit
    from overlapkit.expert_parallel import average_data_parallel_grads

    ref = build(family, **extra)
    model = make(copy.deepcopy(ref)) if make is not None else \
        overlapkit.parallelize(copy.deepcopy(ref), groups.mesh, **({} if plan is None else {"plan": plan}),
                               **(options or {}))
    dp = groups.sizes.dp
    ids = torch.randint(3, 64, (2 * dp, 8), generator=torch.Generator().manual_seed(1))
    masks = torch.ones_like(ids)
    if mask:
        masks[::2, :3] = 0
    mine, my_mask = ids.chunk(dp)[groups.dp_rank], masks.chunk(dp)[groups.dp_rank]
    feed = (lambda i, m: dict(input_ids=i, labels=i, attention_mask=m)) if mask else \
        (lambda i, m: dict(input_ids=i, labels=i))
    out = model(**feed(mine, my_mask))
    out.loss.backward()
    average_data_parallel_grads(model, groups.dp, groups.ep)
    ref_loss = 0.0
    for part, part_mask in zip(ids.chunk(dp), masks.chunk(dp)):
        r = ref(**feed(part, part_mask))
        (r.loss / dp).backward()
        ref_loss += r.loss.item() / dp
    loss = torch.tensor([out.loss.item()], dtype=torch.float64)
    dist.all_reduce(loss)
    errs = {"loss": abs(loss.item() / dist.get_world_size() - ref_loss) / abs(ref_loss)}
    ref_params = dict(ref.named_parameters())
    held = whole = 0
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        want = ref_params[name].grad
        errs[name] = ((grad - want).norm() / want.norm().clamp_min(1e-6)).item()
        if getattr(p, "expert_parallel", False):
            held += p.to_local().numel()
            whole += p.numel()
    errs["expert_fraction"] = held / max(whole, 1)
    # routers whose logits are gathered over tp for the aux loss: the sequence is split before them
    errs["routers_on_slices"] = sum(type(m.__dict__.get("forward")).__name__ == "_GatheredLogits" for m in model.modules())
    return errs
