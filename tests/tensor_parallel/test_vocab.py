"""Vocabulary-parallel embedding and cross-entropy equal nn.Embedding and F.cross_entropy, forward and backward."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distributed import distributed
from overlapkit.tensor_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _ce_case(vocab: int, shape, reduction: str, ignore: bool, dtype) -> float:
    ws, r = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(vocab + len(shape))
    full = (3 * torch.randn(*shape, vocab, generator=gen)).to(dtype)
    targets = torch.randint(0, vocab, shape, generator=gen)
    if ignore:
        targets.view(-1)[::3] = -100
    ref_in = full.clone().float().requires_grad_(True)
    ref = F.cross_entropy(ref_in.reshape(-1, vocab), targets.reshape(-1), reduction=reduction)
    ref = ref.reshape(shape) if reduction == "none" else ref
    weights = torch.randn(ref.shape, generator=gen)
    (ref * weights).sum().backward()

    local = full.chunk(ws, -1)[r].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, targets, dist.group.WORLD, reduction=reduction)
    (loss * weights).sum().backward()
    assert loss.dtype == torch.float32 and local.grad.dtype == dtype
    return max(_rel(loss, ref), _rel(local.grad, ref_in.grad.chunk(ws, -1)[r]))


def _embedding_case(padding_idx=None) -> float:
    ws = dist.get_world_size()
    torch.manual_seed(1)
    ref = nn.Embedding(6 * ws, 5, padding_idx=padding_idx)
    emb = VocabParallelEmbedding.from_full(ref, dist.group.WORLD)
    ids = torch.randint(0, 6 * ws, (3, 7), generator=torch.Generator().manual_seed(2))
    if padding_idx is not None:
        ids[0, :2] = padding_idx % (6 * ws)  # looked up: its row must stay zero and get no gradient
    g = torch.randn(3, 7, 5, generator=torch.Generator().manual_seed(3))
    out = emb(ids)
    (out * g).sum().backward()
    (ref(ids) * g).sum().backward()
    return max(_rel(out, ref(ids)), _rel(emb.weight.grad.to_local(), emb.shard_of(ref.weight.grad)),
               _rel(emb.weight.full_tensor(), ref.weight))


def _errors_of(fn, *args):
    try:
        fn(*args)
    except (ValueError, TypeError) as e:
        return str(e)
    return None


def _cases():
    ws = dist.get_world_size()
    out = {}
    for reduction in ("mean", "sum", "none"):
        for ignore in (False, True):
            out[("ce", reduction, ignore)] = _ce_case(8 * ws, (2, 5), reduction, ignore, torch.float32)
    out[("ce", "bf16")] = _ce_case(8 * ws, (4,), "mean", True, torch.bfloat16)
    out["embedding"] = _embedding_case()
    # padding_idx (HF models with a pad token): the row held by the middle rank, and a negative index.
    out["embedding padding_idx"] = _embedding_case(6 * ws // 2 + 1)
    out["embedding padding_idx<0"] = _embedding_case(-1)
    # DTensor logits (what the plans' heads return) carry their group.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",))
    full = torch.randn(3, 4 * ws, generator=torch.Generator().manual_seed(4))
    t = torch.tensor([0, 4 * ws - 1, 2])
    dt = DTensor.from_local(full.chunk(ws, -1)[dist.get_rank()], mesh, [Shard(1)], run_check=False)
    out["dtensor"] = _rel(vocab_parallel_cross_entropy(dt, t), F.cross_entropy(full, t))
    bad = {
        "target": _errors_of(vocab_parallel_cross_entropy, full.chunk(ws, -1)[0], torch.tensor([0, 4 * ws, 1]),
                             dist.group.WORLD),
        "shape": _errors_of(vocab_parallel_cross_entropy, full.chunk(ws, -1)[0], t[:2], dist.group.WORLD),
        "placement": _errors_of(vocab_parallel_cross_entropy,
                                DTensor.from_local(full, mesh, [Shard(0)], run_check=False), t),
        "vocab": _errors_of(VocabParallelEmbedding, 4 * ws + 1, 3, dist.group.WORLD),
    }
    return out, bad


@distributed(world_size=3)
def _tp3():
    return _cases()


def test_vocab_parallel_matches_unsharded_odd_tp():
    # tp 2 and 4 run through the GPT and HF Llama tests (tests/models), which use both.
    results = _tp3()
    ws = len(results)
    for errs, bad in results:
        for key, err in errs.items():
            # bf16 logits: the reference sees the same bf16 values upcast, so only the returned
            # gradient's rounding to bf16 (2^-8 relative) differs.
            assert err <= (4e-3 if "bf16" in key else 1e-5), (key, err)
        assert bad["target"] == (f"vocab_parallel_cross_entropy: target ids must be in [0, {4 * ws}) or "
                                 f"ignore_index=-100; got [{4 * ws}]")
        assert "targets have shape (2,), the logits (3, 4)" in bad["shape"]
        assert "sharded on their last dim" in bad["placement"]
        assert f"vocabulary size {4 * ws + 1} is not divisible by the tensor-parallel size {ws}" in bad["vocab"]
    assert all(b == results[0][1] for _, b in results)  # every rank fails alike
