"""Cases the CP tests run inside spawned ranks (several per world: spawning is the expensive part)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from overlapkit.runtime.comm import group_rank, group_size
from overlapkit.context_parallel import ContextParallelConfig, ring_attention, shard

TOL = 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.detach().double() - b.detach().double()).abs().max() / b.detach().double().abs().max()).item()


def attention_errors(group, *, causal: bool, heads: int, kv_heads: int, config: ContextParallelConfig,
                     seq_per_rank: int = 4, batch: int = 2, dim: int = 8, seed: int = 0) -> float:
    """Max rel error of the local output and of the local q, k, v grads against one-process attention."""
    size, rank = group_size(group), group_rank(group)
    g = torch.Generator().manual_seed(seed)
    s = seq_per_rank * size
    q = torch.randn(batch, heads, s, dim, generator=g, requires_grad=True)
    k = torch.randn(batch, kv_heads, s, dim, generator=g, requires_grad=True)
    v = torch.randn(batch, kv_heads, s, dim, generator=g, requires_grad=True)
    dout = torch.randn(batch, heads, s, dim, generator=g)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=kv_heads != heads)
    ref.backward(dout)

    def mine(t):
        return shard(t.detach(), 2, rank, size, config.layout).requires_grad_()
    ql, kl, vl = mine(q), mine(k), mine(v)
    out = ring_attention(ql, kl, vl, group, causal=causal, config=config)
    out.backward(shard(dout, 2, rank, size, config.layout))
    pairs = [(out, ref), (ql.grad, q.grad), (kl.grad, k.grad), (vl.grad, v.grad)]
    return max(rel(a, shard(b, 2, rank, size, config.layout)) for a, b in pairs)


def all_attention_cases(group) -> dict[str, float]:
    """Causal and not, GQA and not, every layout, kernel and overlap mode: {case: max rel error}."""
    out = {}
    for causal in (True, False):
        for heads, kv_heads in ((2, 2), (4, 2)):
            for layout in ("zigzag", "contiguous"):
                for kernel in ("math", "flash"):
                    for overlap in ("pipelined", "bulk", "none"):
                        if overlap == "none" and (kernel, layout) != ("math", "zigzag"):
                            continue  # the sequential schedule computes the same blocks; one form checks it
                        if overlap == "bulk" and (kernel, layout) == ("flash", "contiguous"):
                            continue  # the all-gather schedule's blocks are the ring's: each layout, each kernel once
                        for prefetch in ((None, 1) if (overlap, kernel, layout) == ("bulk", "math", "zigzag") else (None,)):
                            cfg = ContextParallelConfig(overlap=overlap, layout=layout, kernel=kernel, prefetch=prefetch)
                            key = f"causal={causal} h={heads}/{kv_heads} {layout} {kernel} {overlap}"
                            key += "" if prefetch is None else f" prefetch={prefetch}"
                            out[key] = attention_errors(group, causal=causal, heads=heads, kv_heads=kv_heads,
                                                        config=cfg)
    return out


def rejections(group) -> dict[str, str]:
    """The messages every rank gets for a sequence that splits unevenly and for configurations that differ."""
    from overlapkit.runtime.agreement import RankMismatchError

    rank = dist.get_rank(group)
    out = {}
    try:
        shard(torch.zeros(1, 1, 6, 2), 2, rank, dist.get_world_size(group), "zigzag")
    except ValueError as e:
        out["uneven_shard"] = str(e)
    q = torch.zeros(1, 2, 3, 4)  # 3 local tokens cannot be a zigzag rank's two equal chunks
    try:
        ring_attention(q, q, q, group)
    except ValueError as e:
        out["uneven_local"] = str(e)
    q = torch.randn(1, 2, 4, 4)
    try:
        ring_attention(q, q, q, group, causal=rank == 0)
    except RankMismatchError as e:
        out["mismatch_causal"] = str(e)
    q = torch.randn(1, 2, 4 + 2 * rank, 4)
    try:
        ring_attention(q, q, q, group)
    except RankMismatchError as e:
        out["mismatch_seq"] = str(e)
    q = torch.randn(1, 2, 4, 4)
    try:  # one rank on the all-gather schedule, the other on the ring: neither may run (nor hang)
        ring_attention(q, q, q, group, config=ContextParallelConfig(overlap="bulk" if rank == 0 else "pipelined"))
    except RankMismatchError as e:
        out["mismatch_overlap"] = str(e)
    return out


def recorded_overlap(group, overlap: str, prefetch: int | None = None) -> dict:
    """Forward + backward of a ring big enough to time, under the recorder: the report's cp_kv row and the spans."""
    from overlapkit.timeline import record, report_spans

    size, rank = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 128 * size, 32, generator=g) for _ in range(3))
    ql, kl, vl = (shard(t, 2, rank, size, "zigzag").requires_grad_() for t in (q, k, v))
    cfg = ContextParallelConfig(overlap=overlap, kernel="math", prefetch=prefetch)
    ring_attention(ql, kl, vl, group, config=cfg).sum().backward()  # warm-up (and the agreement)
    dist.barrier(group)
    with record() as rec:
        ring_attention(ql, kl, vl, group, config=cfg).sum().backward()
    spans = rec.spans
    row = next(r for r in report_spans(spans).ranks[0].by_kind if r.kind == "cp_kv")
    computes = [s for s in spans if s.is_compute and not s.name.endswith(".merge")]
    kv = [s for s in spans if s.kind == "cp_kv"]
    hidden_by_span = [sum(max(0.0, min(s.end_ms, c.end_ms) - max(s.start_ms, c.start_ms)) for c in computes)
                      for s in kv]
    # How many blocks' attention each K/V transfer ran beside (the ring: one; all-gather: up to P−1).
    blocks_beside = {s.name: sum(c.start_ms < s.end_ms and s.start_ms < c.end_ms for c in computes) for s in kv}
    return dict(count=row.count, comm_ms=row.comm_ms, exposed_ms=row.exposed_ms,
                names=sorted({s.name for s in kv}), max_hidden_ms=max(hidden_by_span), blocks_beside=blocks_beside)


def bulk_receives(group) -> list[str]:
    """The cp_kv receives one recorded fwd+bwd of the all-gather schedule makes, causal with the contiguous
    layout (an earlier rank never attends a later one's keys, so those blocks must not travel)."""
    from overlapkit.timeline import record

    size, rank = dist.get_world_size(group), dist.get_rank(group)
    q = torch.randn(1, 2, 4 * size, 8, generator=torch.Generator().manual_seed(6))
    ql = shard(q, 2, rank, size, "contiguous").requires_grad_()
    cfg = ContextParallelConfig(overlap="bulk", layout="contiguous", kernel="math")
    ring_attention(ql, ql, ql, group, config=cfg).sum().backward()  # the agreement, outside the recording
    with record() as rec:
        ring_attention(ql, ql, ql, group, config=cfg).sum().backward()
    return sorted(s.name for s in rec.spans if s.kind == "cp_kv")


def llama_errors(group, kernel: str = "math") -> float:
    """Tiny random HF Llama (GQA, RoPE) at cp=size vs one process: max rel error of logits and every grad."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    from overlapkit.context_parallel import shard_batch
    from overlapkit.models.hf_ring_attention import apply_to_hf

    size, rank = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.0)
    ref = LlamaForCausalLM(cfg)
    model = apply_to_hf(copy.deepcopy(ref), group, ContextParallelConfig(kernel=kernel))
    ids = torch.randint(0, 64, (2, 8 * size), generator=torch.Generator().manual_seed(2))
    tgt = torch.randint(0, 64, (2, 8 * size), generator=torch.Generator().manual_seed(3))
    ref_logits = ref(ids).logits
    F.cross_entropy(ref_logits.reshape(-1, 64), tgt.reshape(-1)).backward()
    local_ids, pos = shard_batch(ids, group)
    try:
        model(input_ids=local_ids)
        raise AssertionError("a CP Llama ran without position_ids")
    except ValueError as e:
        assert "pass position_ids" in str(e), e
    logits = model(input_ids=local_ids, position_ids=pos).logits
    local_tgt = shard(tgt, 1, rank, size, "zigzag")
    # Each rank's share of the global mean; the grads of replicated parameters sum over CP ranks.
    (F.cross_entropy(logits.reshape(-1, 64), local_tgt.reshape(-1), reduction="sum") / tgt.numel()).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, group=group)
    errs = [rel(logits, shard(ref_logits, 1, rank, size, "zigzag"))]
    errs += [rel(p.grad, r.grad) for p, r in zip(model.parameters(), ref.parameters())]
    return max(errs)


def gpt_cp_dp_errors(steps: int = 2) -> list[float]:
    """Our GPT trained with CP=2 x DP=2 vs one process: per step, max rel error of loss, logits and grads."""
    import copy

    from overlapkit.context_parallel import replicas_group, shard_batch
    from overlapkit.models.ring_attention import apply_to_gpt
    from overlapkit.data_parallel import DataParallel
    from overlapkit.runtime.groups import ParallelGroups
    from overlapkit.models.gpt import GPT, GPTConfig, lm_loss

    groups = ParallelGroups.build(cp=2, dp=2)
    torch.manual_seed(0)
    ref = GPT(GPTConfig(vocab_size=32, seq_len=8, hidden=16, num_heads=2, ffn_hidden=32, num_layers=2))
    model = DataParallel(apply_to_gpt(copy.deepcopy(ref), groups.cp), replicas_group(groups))
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref))
    gen = torch.Generator().manual_seed(1)
    rows = slice(2 * groups.dp_rank, 2 * groups.dp_rank + 2)
    errors = []
    for _ in range(steps):
        idx, tgt = (torch.randint(0, 32, (4, 8), generator=gen) for _ in range(2))
        ref_opt.zero_grad()
        ref_logits = ref(idx)
        ref_loss = lm_loss(ref_logits, tgt)
        ref_loss.backward()
        model.zero_grad()
        local_idx, _ = shard_batch(idx[rows], groups.cp)
        local_tgt, _ = shard_batch(tgt[rows], groups.cp)
        logits = model(local_idx)  # [s_local, b, V]
        loss = lm_loss(logits, local_tgt)
        loss.backward()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= dist.get_world_size()  # every rank has as many tokens: the mean of means is the mean
        ref_local = shard(ref_logits[:, rows], 0, groups.cp_rank, 2, "zigzag")
        errs = [rel(mean_loss, ref_loss), rel(logits, ref_local)]
        errs += [rel(p.grad, r.grad) for p, r in zip(model.module.parameters(), ref.parameters())]
        errors.append(max(errs))
        opt.step()
        ref_opt.step()
    return errors


def tp_heads_errors() -> float:
    """CP=2 x TP=2: each TP rank rings its own heads over its CP group; equal to those heads of full attention."""
    from overlapkit.runtime.groups import ParallelGroups

    groups = ParallelGroups.build(cp=2, tp=2)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 8, 8, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 8, 8, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 8, 8, generator=g, requires_grad=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ref.sum().backward()
    tp, cp = groups.tp_rank, groups.cp_rank

    def mine(t, heads):
        return shard(t.detach()[:, tp * heads:(tp + 1) * heads], 2, cp, 2, "zigzag").requires_grad_()
    ql, kl, vl = mine(q, 2), mine(k, 1), mine(v, 1)
    out = ring_attention(ql, kl, vl, groups)  # the ParallelGroups: its "cp" dim is used
    out.sum().backward()
    pairs = [(out, ref), (ql.grad, q.grad), (kl.grad, k.grad), (vl.grad, v.grad)]
    heads = [2, 2, 1, 1]
    return max(rel(a, shard(b[:, tp * h:(tp + 1) * h], 2, cp, 2, "zigzag")) for (a, b), h in zip(pairs, heads))


# Seconds each overlap mode's forward is slowed by, per rank of a CP pair. PIPELINED: rank 0 alone would keep
# `bulk`; the slowest rank's times (pipelined 0.06, bulk and none 0.12) keep `pipelined`. BULK: rank 1 alone
# would keep `pipelined`; the slowest rank's (pipelined 0.12, bulk 0.06, none 0.12) keep `bulk`.
AUTO_DELAYS = {"pipelined": ({"pipelined": 0.06, "bulk": 0.0, "none": 0.0},
                             {"pipelined": 0.0, "bulk": 0.12, "none": 0.12}),
               "bulk": ({"pipelined": 0.12, "bulk": 0.06, "none": 0.0},
                        {"pipelined": 0.0, "bulk": 0.0, "none": 0.12})}


def auto_overlap(group, expect: str = "pipelined") -> dict:
    """overlap="auto" (the default) on a RingAttention: trials, the decision, then calls under the recorder
    with the trial clock made to fail if read: what ran, and what was kept."""
    import time

    from overlapkit.context_parallel import RingAttention, attention
    from trial_clock import recorded_without_trial_clock

    rank = dist.get_rank(group)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 8 * dist.get_world_size(group), 8, generator=g) for _ in range(3))
    ql, kl, vl = (shard(t, 2, rank, dist.get_world_size(group), "zigzag").requires_grad_() for t in (q, k, v))
    ring = RingAttention(group, ContextParallelConfig(kernel="math"))
    forward = attention.forward_pass

    def slowed(r, *args):
        time.sleep(AUTO_DELAYS[expect][rank][r.overlap])
        return forward(r, *args)

    attention.forward_pass = slowed
    try:
        ring(ql, kl, vl).sum().backward()
        choice, = ring.overlap_choices.choices().values()
        for _ in range(choice.trial_calls - 1):
            ring(ql, kl, vl).sum().backward()
    finally:
        attention.forward_pass = forward

    # The deciding call, then two that run as a fixed configuration would.
    spans = recorded_without_trial_clock(lambda: ring(ql, kl, vl).sum().backward())
    names = [sorted(s.name for s in spans if s.step == i and s.is_comm) for i in (1, 2, 3)]
    return dict(decided=choice.decided, reason=choice.reason, names=names)
