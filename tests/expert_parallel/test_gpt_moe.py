"""TP inside the experts, and the GPT with MoE blocks under EP carved from DP (x TP without SP), equal one process."""

import pytest
import torch
import torch.distributed as dist

from overlapkit.runtime.agreement import RankMismatchError
from overlapkit.expert_parallel import MoE, average_data_parallel_grads, init_full_experts
from overlapkit.models.moe_gpt import solo_group
from overlapkit.runtime.groups import ParallelGroups
from overlapkit.models import GPT, GPTConfig, expected_local, lm_loss, parallelize
from reference import reference_moe
from test_moe import _rel
from worlds import world

H, F = 8, 12


def _tp_inside_experts(groups: ParallelGroups) -> dict:
    """ep=2 x tp=2: each expert's MLP split over TP, the TP ranks holding the same tokens."""
    dp, r = groups.sizes.dp, groups.dp_rank
    moe = MoE(H, F, 4, 2, groups, tp_group=groups.tp, chunks=2)
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(5 + 3 * i, H, generator=g) for i in range(dp)]
    dys = [torch.randn(x.shape, generator=g) for x in xs]
    gate = torch.randn(4, H, generator=g)
    full = init_full_experts(4, H, F, g)
    with torch.no_grad():
        moe.router.gate.weight.copy_(gate)
    moe.load_full(*full)
    x = xs[r].clone().requires_grad_()
    ((moe(x) * dys[r]).sum() + 0.1 * moe.aux_loss).backward()
    ref = [p.clone().requires_grad_() for p in (gate, *full)]
    rx = [xi.clone().requires_grad_() for xi in xs]
    loss = 0
    for i in range(dp):
        o, aux, _ = reference_moe(rx[i], *ref, 2)
        loss = loss + (o * dys[i]).sum() + 0.1 * aux
        if i == r:
            ref_out = o.detach()
    loss.backward()
    router = moe.router.gate.weight.grad.clone()
    dist.all_reduce(router, group=groups.dp)
    out = moe(x.detach())
    errs = dict(out=_rel(out, ref_out), dx=_rel(x.grad, rx[r].grad), router=_rel(router, ref[0].grad))
    e = moe.experts
    for name, p, full_p in zip(("w1", "b1", "w2", "b2"), (e.w1, e.b1, e.w2, e.b2), ref[1:]):
        errs[name] = _rel(p.grad, moe.shard_of(full_p.grad, name))
    try:  # sequence-parallel shards (different tokens per TP rank) are refused, on every rank
        moe(torch.randn(6, H) + groups.tp_rank)
        refused = "no error"
    except RankMismatchError as err:
        refused = str(err)
    return dict(errs=errs, refused=refused)


def _gpt(groups: ParallelGroups, solo) -> dict:
    """GPT with a MoE in block 1 (of 2): EP over DP, the dense layers TP without SP, TP inside the experts."""
    dp, tp = groups.sizes.dp, groups.sizes.tp
    cfg = GPTConfig(vocab_size=8 * tp, seq_len=4, hidden=8 * tp, num_heads=2 * tp, ffn_hidden=8 * tp, num_layers=2)

    def build(moe_group, tp_group):
        torch.manual_seed(11)
        return GPT(cfg, moe_every=2, moe=lambda i: MoE(cfg.hidden, cfg.ffn_hidden, 2 * dp, 2, moe_group,
                                                        tp_group=tp_group, chunks=3, name=f"blocks.{i}.moe"))
    ref = build(solo, None)
    model = parallelize(build(groups, groups.tp), groups, sequence_parallel=False)
    gen = torch.Generator().manual_seed(2)
    idx = torch.randint(0, cfg.vocab_size, (2 * dp, cfg.seq_len), generator=gen)
    tgt = torch.randint(0, cfg.vocab_size, (2 * dp, cfg.seq_len), generator=gen)
    rows = slice(2 * groups.dp_rank, 2 * groups.dp_rank + 2)
    loss = lm_loss(model(idx[rows]), tgt[rows]) + 0.01 * model.aux_loss()
    loss.backward()
    average_data_parallel_grads(model, groups.dp, groups.ep)
    ref_loss = 0
    for d in range(dp):  # the mean of the DP ranks' losses, each with its own tokens' aux loss
        sl = slice(2 * d, 2 * d + 2)
        ref_loss = ref_loss + (lm_loss(ref(idx[sl]), tgt[sl]) + 0.01 * ref.aux_loss()) / dp
    ref_loss.backward()
    full_loss = loss.detach().clone()
    dist.all_reduce(full_loss, group=groups.dp)
    errs = {"loss": _rel(full_loss / dp, ref_loss.detach())}
    moe = model.blocks[1].mlp
    for name, local, full in expected_local(model, ref, "grad"):
        if ".mlp.experts." in name:
            full = moe.shard_of(full, name.rsplit(".", 1)[1])
        errs[name] = _rel(local, full)
    return errs


def _tp_and_gpt() -> dict:
    solo = solo_group()
    groups = ParallelGroups.build(tp=2, dp=2, ep=2)
    return dict(tp=_tp_inside_experts(groups), gpt=_gpt(groups, solo))


# torch's parallelize_module warns that the MLP plan's fc1/fc2 are absent inside a MoE block: it is.
@pytest.mark.filterwarnings("ignore:Parallelize plan key")
def test_tp_inside_experts_and_gpt_with_ep_from_dp_match_one_process():
    for r in world(4):
        assert max(r["tp"]["errs"].values()) <= 1e-5, r["tp"]["errs"]
        assert "needs its TP ranks to hold the same tokens" in r["tp"]["refused"], r["tp"]["refused"]
        bad = {k: v for k, v in r["gpt"].items() if v > 1e-5}
        assert not bad, bad
