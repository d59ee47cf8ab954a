"""Ring attention in transformers models of every family with the attention interface, chosen by
`parallelize` on a mesh with a cp dim, equals one process: the model's own labels= loss (through
shift_labels, some -100) and every gradient, fp32, rel <= 1e-5, on Llama, Qwen2, Qwen3, Mistral
(sliding window longer than the sequence), Gemma, Gemma 3 and eight more families at cp 2, on three
at cp 3, on Llama, Qwen2 and Gemma 3 at cp 4, and cp 2 x tp 2; what the ring cannot compute (soft-capped attention logits, a window shorter
than the sequence, labels shifted locally) is refused naming it.
"""

import copy

import pytest
import torch
import torch.distributed as dist

from distributed import distributed

pytest.importorskip("transformers")

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma3_text", "granite", "cohere", "phi3", "olmo", "olmo2",
            "starcoder2", "gpt_neox", "phi")
"""Every family that passes TP today, whose attention goes through the attention interface (Gemma 2 is refused)."""


def build(family: str, tp: int = 1, seed: int = 0, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    heads, kv = (4, 2)
    kw = dict(hidden_size=8 * heads, intermediate_size=16 * heads, num_hidden_layers=2, num_attention_heads=heads,
              num_key_value_heads=kv, head_dim=8, vocab_size=32 * tp, max_position_embeddings=64, pad_token_id=1,
              bos_token_id=0, eos_token_id=2, attn_implementation="sdpa")
    kw.update(extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **kw))
    with torch.no_grad():  # norms not all ones, biases not zero: a wrong one's gradient must show
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5) if "norm" in name else p.uniform_(-0.1, 0.1)
    return model.float()


def rel(a, b) -> float:
    a, b = (t.to_local() if hasattr(t, "to_local") else t for t in (a, b))
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def case(mesh, cp_group, family: str, tp: int = 1, **extra) -> float:
    """Worst relative error of the loss and every gradient (summed over the cp ranks) against one process."""
    import overlapkit
    from overlapkit.context_parallel import shard_batch, shard_labels
    from overlapkit.models import expected_local

    size = dist.get_world_size(cp_group)
    ref = build(family, tp, **extra)
    model = overlapkit.parallelize(copy.deepcopy(ref), mesh)
    ids = torch.randint(0, ref.config.vocab_size, (2, 4 * size * tp), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, 3:6] = -100
    want = ref(input_ids=ids, labels=labels).loss
    want.backward()
    local, pos = shard_batch(ids, cp_group)
    shift = shard_labels(labels, cp_group)
    items = int((labels[..., 1:] != -100).sum())
    # Each rank's share: its tokens' losses over the whole batch's count; the shares sum to the loss.
    loss = model(input_ids=local, position_ids=pos, labels=shift, shift_labels=shift, num_items_in_batch=items).loss
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=cp_group)
    errs = [abs(total.item() - want.item()) / abs(want.item())]
    for _, local_grad, full in expected_local(model, ref, "grad"):
        g = local_grad.clone()
        dist.all_reduce(g, group=cp_group)  # replicated over cp: each rank holds its tokens' part
        errs.append(rel(g, full))
    return max(errs)


def refusals(mesh, cp_group) -> dict:
    import overlapkit
    from overlapkit.context_parallel import shard_batch

    out = {}
    try:
        overlapkit.parallelize(build("gemma2", attn_implementation="eager"), mesh)
        out["softcap"] = "no error"
    except ValueError as e:
        out["softcap"] = str(e)
    size = dist.get_world_size(cp_group)
    model = overlapkit.parallelize(build("mistral", sliding_window=2 * size), mesh)
    ids = torch.randint(0, 32, (1, 4 * size))
    local, pos = shard_batch(ids, cp_group)
    for key, kwargs in (("window", dict(position_ids=pos)), ("labels", dict(position_ids=pos, labels=local)),
                        ("positions", {})):
        try:
            model(input_ids=local, **kwargs)
            out[key] = "no error"
        except ValueError as e:
            out[key] = str(e)
    return out


def _cp_mesh():
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))


@distributed(world_size=2, timeout_s=120)
def _cp2():
    mesh = _cp_mesh()
    group = mesh.get_group("cp")
    return {f: case(mesh, group, f) for f in FAMILIES}, refusals(mesh, group)


@distributed(world_size=3, timeout_s=120)
def _cp3():
    mesh = _cp_mesh()
    return {f: case(mesh, mesh.get_group("cp"), f) for f in ("llama", "qwen3", "mistral")}


@distributed(world_size=4, timeout_s=180)
def _cp4():
    mesh = _cp_mesh()
    return {f: case(mesh, mesh.get_group("cp"), f) for f in ("llama", "qwen2", "gemma3_text")}


@distributed(world_size=4, timeout_s=180)
def _cp2_tp2():
    import overlapkit

    groups = overlapkit.ParallelGroups.build(cp=2, tp=2)
    return {f: case(groups, groups.cp, f, tp=2) for f in ("llama", "qwen2", "qwen3")}


def _check(per_rank):
    for rank, errs in enumerate(per_rank):
        bad = {k: e for k, e in errs.items() if not e <= 1e-5}
        assert not bad, (rank, bad)


def test_every_family_at_cp2_matches_one_process_and_refuses_what_the_ring_cannot_compute():
    results = _cp2()
    _check([r[0] for r in results])
    for _, refused in results:
        assert "attn_logit_softcapping" in refused["softcap"], refused
        assert "config.sliding_window" in refused["window"], refused
        assert "shift_labels" in refused["labels"], refused
        assert "pass position_ids" in refused["positions"], refused


def test_cp3_matches_one_process():
    _check(_cp3())


def test_cp4_matches_one_process():
    _check(_cp4())


def test_cp2_with_tp2_matches_one_process():
    _check(_cp2_tp2())
