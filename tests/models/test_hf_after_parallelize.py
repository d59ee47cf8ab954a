"""What an HF user does after `parallelize`, compared with the unsharded model in numbers.

clip_grad_norm_ (foreach on and off) and get_total_norm over the whole model; foreach and
fused AdamW, an EMA and a weight-decay loop over `model.parameters()` with no param groups;
a tied Qwen2 under a hand-written plan (one parameter, the tied gradient, equal after a step);
save_pretrained -> a plain model loads it bit-equal, and the checkpoint loads back into a
parallelized model; PyTorch's FSDP2 `fully_shard(mesh["dp"])` on top of TP on a named 2-D mesh.
"""

import copy

import pytest
import torch
import torch.distributed as dist

from distributed import distributed

pytest.importorskip("transformers")

import hf_families  # noqa: E402  (pytest puts this folder on sys.path; spawned ranks inherit it)


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-3)).item()


def _ids(vocab: int, batch: int, seq: int, seed: int = 1):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _max_param_err(model, ref) -> float:
    refs = dict(ref.named_parameters())
    return max(_rel(_full(p.detach()), refs[n].detach()) for n, p in model.named_parameters())


def _step(model, opt, ids, clip: float | None = None, foreach: bool | None = None):
    opt.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=foreach) if clip else None
    opt.step()
    return norm


def _pair(mesh, backward: bool = True):
    """(parallelized Llama, unsharded one), equal weights; with the gradients of one batch.

    Llama, not Qwen2: a key bias's gradient is ~1e-7 rounding noise (softmax ignores it), and
    Adam turns any noise into a full-size step, so its parameters would differ by design."""
    import overlapkit

    ref = hf_families.build("llama", 2)
    model = overlapkit.parallelize(copy.deepcopy(ref), mesh, overlap="bulk")
    if backward:
        ids = _ids(64, 2, 8)
        for m in (model, ref):
            m(input_ids=ids, labels=ids).loss.backward()
    return model, ref


def _whole_model_loops(mesh) -> dict:
    from torch.distributed.tensor import DTensor

    out = {}
    model, ref = _pair(mesh)
    out["all_dtensor"] = float(all(isinstance(p, DTensor) for p in model.parameters()))
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    out["get_total_norm"] = _rel(_full(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])), ref_norm)
    for foreach in (True, False):
        m, r = _pair(mesh)
        n = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05, foreach=foreach)
        rn = torch.nn.utils.clip_grad_norm_(r.parameters(), 0.05, foreach=foreach)
        out[f"clip_norm_foreach={foreach}"] = _rel(_full(n), rn)
        out[f"clipped_grads_foreach={foreach}"] = max(_rel(_full(p.grad), q.grad)
                                                      for p, q in zip(m.parameters(), r.parameters()))
    for kind in ("foreach", "fused"):
        m, r = _pair(mesh, backward=False)
        # eps=1e-3: with torch's 1e-8 Adam's first steps are ~g/|g| per element, so an element whose
        # gradient is ~1e-10 moves by a full step whichever way its rounding went (measured: the
        # gradients agree to 3e-7, the parameters to 5e-5 only).
        opts = dict(lr=1e-2, weight_decay=0.1, eps=1e-3, **{kind: True})
        om, orf = torch.optim.AdamW(m.parameters(), **opts), torch.optim.AdamW(r.parameters(), **opts)
        for step in range(2):
            _step(m, om, _ids(64, 2, 8, step), clip=1.0)
            _step(r, orf, _ids(64, 2, 8, step), clip=1.0)
        out[f"adamw_{kind}_two_steps"] = _max_param_err(m, r)
        out[f"adamw_{kind}_moments"] = max(_rel(_full(om.state[p][k]), orf.state[q][k]) for p, q in
                                           zip(m.parameters(), r.parameters()) for k in ("exp_avg", "exp_avg_sq"))
    ema, ema_ref = [p.detach().clone() for p in model.parameters()], [p.detach().clone() for p in ref.parameters()]
    with torch.no_grad():
        torch._foreach_lerp_(ema, [p.detach() * 2 for p in model.parameters()], 0.1)
        torch._foreach_lerp_(ema_ref, [p.detach() * 2 for p in ref.parameters()], 0.1)
        for p in model.parameters():
            p.mul_(1 - 1e-2 * 0.1)  # a hand-written decoupled weight decay
        for p in ref.parameters():
            p.mul_(1 - 1e-2 * 0.1)
    out["ema"] = max(_rel(_full(a), b) for a, b in zip(ema, ema_ref))
    out["weight_decay_loop"] = _max_param_err(model, ref)
    return out


def _tied_qwen2_hand_plan(mesh) -> dict:
    """The docs' hand-written Qwen2 plan on a tied model: one parameter, the tied gradient, equal after a step."""
    import overlapkit
    from overlapkit.tensor_parallel import (ColwiseParallel, GatherSequence, RowwiseParallel, ScatterSequence,
                                            SequenceParallel, VocabParallel)

    sp = dict(overlap="bulk", sequence_parallel=True, sequence_dim=1)
    qkv = ColwiseParallel(input_gathered=True)
    plan = {"model.embed_tokens": VocabParallel(), "model.layers.0": ScatterSequence(sequence_dim=1),
            "model.layers.*.input_layernorm": SequenceParallel(), "model.layers.*.self_attn": GatherSequence(sequence_dim=1),
            "model.layers.*.self_attn.q_proj": qkv, "model.layers.*.self_attn.k_proj": qkv,
            "model.layers.*.self_attn.v_proj": qkv, "model.layers.*.self_attn.o_proj": RowwiseParallel(**sp),
            "model.layers.*.post_attention_layernorm": SequenceParallel(),
            "model.layers.*.mlp.gate_proj": ColwiseParallel(**sp), "model.layers.*.mlp.up_proj": ColwiseParallel(**sp),
            "model.layers.*.mlp.down_proj": RowwiseParallel(**sp), "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(**sp, use_local_output=False)}
    ref = hf_families.build("qwen2", 2, tie_word_embeddings=True)
    model = overlapkit.parallelize(copy.deepcopy(ref), mesh, plan=plan)
    out = {"parameters": abs(len(list(model.parameters())) - len(list(ref.parameters()))),
           "one_tensor": float(model.lm_head.weight is not model.model.embed_tokens.weight)}
    om, orf = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    ids = _ids(64, 2, 8)
    _step(model, om, ids)
    _step(ref, orf, ids)
    out["tied_grad"] = _rel(_full(model.lm_head.weight.grad), ref.lm_head.weight.grad)
    out["after_step"] = _max_param_err(model, ref)
    out["head_is_embedding_after_step"] = _rel(_full(model.lm_head.weight.detach()), ref.model.embed_tokens.weight.detach())
    # A plan that would split the two halves of one tied parameter differently is refused, naming them.
    bad = {**plan, "lm_head": RowwiseParallel(**sp)}
    try:
        overlapkit.parallelize(hf_families.build("qwen2", 2, tie_word_embeddings=True), mesh, plan=bad)
        out["refused"] = ""
    except ValueError as e:
        out["refused"] = str(e)
    return out


def _save_and_load(mesh, directory: str) -> dict:
    import safetensors.torch
    from transformers import AutoModelForCausalLM

    import overlapkit

    ref = hf_families.build("gemma", 2)  # tied embedding and head, a padding row, a scaled embedding
    model = overlapkit.parallelize(copy.deepcopy(ref), mesh, overlap="bulk")
    model.save_pretrained(directory)
    plain = AutoModelForCausalLM.from_pretrained(directory).float()
    sd, rsd = plain.state_dict(), ref.state_dict()
    out = {"keys": sorted(set(sd) ^ set(rsd)),
           "not_bit_equal": [k for k in rsd if not torch.equal(sd[k], rsd[k])]}
    # Pretrained weights into a parallelized model: a differently seeded one loads the checkpoint.
    other = overlapkit.parallelize(hf_families.build("gemma", 2, seed=5), mesh, overlap="bulk")
    files = safetensors.torch.load_file(f"{directory}/model.safetensors")
    missing, unexpected = other.load_state_dict(files, strict=False)
    out["load_missing"] = [k for k in missing if k != "lm_head.weight"]  # tied: saved once
    ids = _ids(64, 2, 8)
    out["loss_after_load"] = abs(other(input_ids=ids, labels=ids).loss.item() - ref(input_ids=ids, labels=ids).loss.item())
    return out


@distributed(world_size=2, timeout_s=240)
def _tp2(directory: str):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    return _whole_model_loops(mesh), _tied_qwen2_hand_plan(mesh), _save_and_load(mesh, directory)


def test_whole_model_loops_tied_weights_and_save_pretrained(tmp_path):
    for loops, tied, saved in _tp2(str(tmp_path)):
        assert loops.pop("all_dtensor") == 1.0
        assert all(err <= 1e-5 for err in loops.values()), loops
        assert tied.pop("parameters") == 0 and tied.pop("one_tensor") == 0.0
        assert "lm_head.weight" in tied["refused"] and "model.embed_tokens.weight" in tied.pop("refused")
        for key, err in tied.items():
            assert err <= 1e-5, (key, err)
        assert saved["keys"] == [] and saved["not_bit_equal"] == [], saved
        assert saved["load_missing"] == [] and saved["loss_after_load"] <= 1e-5, saved


@distributed(world_size=4, timeout_s=240)
def _fsdp2_over_tp():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import overlapkit

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    # Apertus: its activation's alpha_p/alpha_n sit between up_proj and down_proj, so their
    # gradient is summed over TP (plan_edges.py), found through FSDP2's unsharded parameters.
    for family in ("llama", "apertus"):
        ref = hf_families.build_any(family, 2)
        model = overlapkit.parallelize(copy.deepcopy(ref), mesh, overlap="bulk")
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        ids = _ids(64, 4, 8)
        dp = mesh["dp"].get_local_rank()
        model(input_ids=ids[2 * dp:2 * dp + 2], labels=ids[2 * dp:2 * dp + 2]).loss.backward()
        # FSDP2 averages the two replicas' gradients: the reference is the mean of the two halves' losses.
        ((ref(input_ids=ids[:2], labels=ids[:2]).loss + ref(input_ids=ids[2:], labels=ids[2:]).loss) / 2).backward()
        refs = dict(ref.named_parameters())
        out.update({f"{family}:{n}": _rel(p.grad.full_tensor(), refs[n].grad) for n, p in model.named_parameters()})
    return out


def test_torch_fsdp2_over_dp_on_a_tp_parallelized_hf_model_is_exact():
    for errs in _fsdp2_over_tp():
        for name, err in errs.items():
            assert err <= 1e-5, (name, err)
