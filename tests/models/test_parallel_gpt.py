"""The parallelized tiny GPT equals the plain one: logits (vocabulary-split), loss and every gradient."""

import copy

import pytest
import torch
import torch.distributed as dist

from distributed import distributed
from overlapkit.models import GPT, GPTConfig, expected_local, lm_loss, parallelize
from overlapkit.tensor_parallel.layers import allreduce_sequence_parallel_grads


def _gpt_errors(sp: bool, overlap: str) -> float:
    tp = dist.get_world_size()
    cfg = GPTConfig(vocab_size=8 * tp, seq_len=4 * tp, hidden=8 * tp, num_heads=2 * tp, ffn_hidden=8 * tp, num_layers=2)
    torch.manual_seed(3)
    ref = GPT(cfg)
    model = parallelize(copy.deepcopy(ref), dist.group.WORLD, sequence_parallel=sp, overlap=overlap)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    tgt = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    logits = model(idx)
    lm_loss(logits, tgt).backward()
    allreduce_sequence_parallel_grads(model, dist.group.WORLD)
    ref_logits = ref(idx)
    lm_loss(ref_logits, tgt).backward()
    # The head is split over the vocabulary: each rank holds its columns of the logits.
    ref_cols = ref_logits.chunk(tp, dim=-1)[dist.get_rank()]
    errs = [((logits.to_local() - ref_cols).norm() / ref_cols.norm()).item()]
    for name, local, full in expected_local(model, ref, "grad"):
        errs.append(((local - full).norm() / full.norm().clamp_min(1e-30)).item())
    return max(errs)


@distributed(world_size=3)
def _gpt3():
    return {(sp, ov): _gpt_errors(sp, ov) for sp in (False, True) for ov in ("none", "bulk")}


@distributed(world_size=2)
def _gpt2():
    return {(sp, ov): _gpt_errors(sp, ov) for sp in (False, True) for ov in ("none", "bulk")}


@pytest.mark.parametrize("run", [_gpt2, _gpt3], ids=["tp2", "tp3"])
def test_parallel_gpt_matches_plain(run):
    for per_rank in run():
        for key, err in per_rank.items():
            assert err <= 1e-5, (key, err)
