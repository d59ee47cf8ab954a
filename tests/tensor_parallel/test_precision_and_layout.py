"""Mixed precision, [b, s, h] sequence parallelism, activation checkpointing and TP-aware dropout.

Every overlap mode (none, bulk, pipelined, auto) on a column -> GELU -> row MLP with SP:
- fp32 on [b, s, h] (sequence_dim=1), micro-batch 1 and 2: output and every gradient equal the
  unsharded MLP (rel <= 1e-5), at TP 2 and 3.
- torch.autocast bf16 / fp16 and bf16 parameters: equal to the same unsharded run within
  BF16_TOL / FP16_TOL (norm-wise relative). Why these bounds: both runs round every GEMM output
  to the low dtype (unit roundoff u = 2^-9 for bf16, 2^-11 for fp16); TP additionally rounds
  each rank's partial product of the row GEMM before summing it, and sums in another order, so
  the two runs differ by a few u per element, compounded through GELU and two GEMMs, forward
  and backward: 0.8u-3.4u measured (pipelined the most: its wgrad sums chunks in fp32, the
  reference rounds one bf16 GEMM), bound 16u (bf16: 3.1e-2, fp16: 7.8e-3). A wrong sum (the old
  pipelined-under-autocast bug read bf16 bytes as fp32) is O(1).
- torch.utils.checkpoint (non-reentrant) around the layers: the same gradients as without.
- torch.compile (backend "eager") of the MLP with SP: same numbers as the unsharded one.
- dropout: masks inside `sharded_rng` differ across TP ranks, default-stream masks match, and
  checkpointing recomputes the same sharded masks.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from distributed import distributed
from overlapkit.runtime.agreement import RankMismatchError
from overlapkit.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from overlapkit.tensor_parallel import p2p
from overlapkit.tensor_parallel.random import check_rng_in_sync, sharded_rng

MODES = ("none", "bulk", "pipelined", "auto")
BF16_TOL, FP16_TOL = 16 * 2.0**-9, 16 * 2.0**-11


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _mlp(h: int, f: int, dtype=torch.float32) -> nn.Sequential:
    torch.manual_seed(31)
    return nn.Sequential(nn.Linear(h, f), nn.GELU(), nn.Linear(f, h)).to(dtype)


def _tp(ref: nn.Sequential, group, overlap: str, sd: int) -> nn.Sequential:
    kw = dict(sequence_parallel=True, sequence_dim=sd, overlap=overlap)
    return nn.Sequential(ColumnParallelLinear.from_full(ref[0], group, **kw), nn.GELU(),
                         RowParallelLinear.from_full(ref[2], group, **kw))


def _compare(overlap: str, sd: int, b: int, *, autocast=None, dtype=torch.float32, ckpt: bool = False) -> float:
    """Largest relative error of output, input grad and every param grad vs the unsharded MLP."""
    group, ws, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    h, f, s = 4 * ws, 8 * ws, 2 * ws
    ref = _mlp(h, f, dtype)
    model = _tp(ref, group, overlap, sd)
    shape = (b, s, h) if sd == 1 else (s, b, h)
    torch.manual_seed(32)
    X = torch.randn(*shape, dtype=dtype, requires_grad=True)
    G = torch.randn(*shape, dtype=dtype)
    ctx = torch.autocast("cpu", dtype=autocast) if autocast else torch.autocast("cpu", enabled=False)
    with ctx:
        Y = ref(X)
    (Y.float() * G.float()).sum().backward()
    x = X.detach().chunk(ws, sd)[r].clone().requires_grad_(True)
    with ctx:
        y = checkpoint(model, x, use_reentrant=False) if ckpt else model(x)
    (y.float() * G.chunk(ws, sd)[r].float()).sum().backward()
    errs = [_rel(y, Y.detach().chunk(ws, sd)[r]), _rel(x.grad, X.grad.chunk(ws, sd)[r])]
    for layer, full in ((model[0], ref[0]), (model[2], ref[2])):
        errs.append(_rel(layer.weight.grad.to_local(), layer.shard_of(full.weight.grad)))
        errs.append(_rel(layer.bias.grad.to_local(), layer.shard_of(full.bias.grad)))
    return max(errs)


def _fp32_layouts():
    return {(ov, b): _compare(ov, 1, b) for ov in MODES for b in (1, 2)}


@distributed(world_size=2, timeout_s=90)
def _ws2():
    out = {"fp32": _fp32_layouts()}
    out["bf16 autocast"] = {(ov, sd): _compare(ov, sd, 2, autocast=torch.bfloat16) for ov in MODES for sd in (0, 1)}
    out["fp16 autocast"] = {ov: _compare(ov, 1, 1, autocast=torch.float16) for ov in MODES}
    out["bf16 params"] = {ov: _compare(ov, 0, 2, dtype=torch.bfloat16) for ov in MODES}
    out["checkpoint"] = {ov: _compare(ov, 1, 2, ckpt=True) for ov in ("bulk", "pipelined")}
    out["bf16 autocast + checkpoint"] = _compare("pipelined", 1, 1, autocast=torch.bfloat16, ckpt=True)
    out["partial of another dtype"] = _wrong_partial_dtype()
    out["dropout"] = _dropout_masks()
    out["torch.compile"] = {ov: _compiled(ov) for ov in ("bulk", "pipelined")}
    dist.barrier()
    return out


@distributed(world_size=3, timeout_s=90)
def _ws3():
    return _fp32_layouts()


def _compiled(overlap: str) -> float:
    """torch.compile of the TP+SP MLP (backend eager): output and gradients equal the unsharded MLP."""
    group, ws, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    ref = _mlp(8, 16)
    tp = _tp(ref, group, overlap, 0)
    model = torch.compile(tp, backend="eager")
    X = torch.randn(2 * ws, 2, 8, requires_grad=True)
    ref(X).sum().backward()
    x = X.detach().chunk(ws, 0)[r].clone().requires_grad_(True)
    y = model(x)
    y.sum().backward()
    return max(_rel(y, ref(X).detach().chunk(ws, 0)[r]), _rel(x.grad, X.grad.chunk(ws, 0)[r]),
               _rel(tp[0].weight.grad.to_local(), tp[0].shard_of(ref[0].weight.grad)))


def _wrong_partial_dtype():
    try:  # what a GEMM under autocast used to hand the fp32 receive buffer
        p2p.produce_and_reduce_scatter(lambda rows, out: torch.ones(rows.stop - rows.start, 3, dtype=torch.bfloat16),
                                       4, 3, 1, dist.group.WORLD, dtype=torch.float32, device=torch.device("cpu"),
                                       name="probe")
    except RuntimeError as e:
        return str(e)
    return None


def _dropout_masks():
    group = dist.group.WORLD
    torch.manual_seed(41)
    check_rng_in_sync(group)
    x = torch.ones(64)
    replicated = torch.nn.functional.dropout(x, 0.5)
    with sharded_rng(group):
        sharded = torch.nn.functional.dropout(x, 0.5)
    after = torch.rand(4)  # the default stream stays in step across ranks
    gathered = [torch.empty(3 * 64 + 4) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.cat([replicated, sharded, after, torch.zeros(64)]))

    # Checkpointing replays the same sharded masks: gradients equal the plain run's.
    def f(w):
        with sharded_rng(group):
            return torch.nn.functional.dropout(w * 2.0, 0.5).sum()

    torch.manual_seed(42)
    w1 = torch.randn(32, requires_grad=True)
    f(w1).backward()
    torch.manual_seed(42)
    w2 = torch.randn(32, requires_grad=True)
    checkpoint(f, w2, use_reentrant=False).backward()
    torch.manual_seed(43 + dist.get_rank())  # now the ranks' default streams differ
    try:
        check_rng_in_sync(group)
        unsynced = None
    except RankMismatchError as e:
        unsynced = str(e)
    return dict(replicated_same=all(torch.equal(g[:64], gathered[0][:64]) for g in gathered),
                sharded_differ=not torch.equal(gathered[0][64:128], gathered[1][64:128]),
                after_same=all(torch.equal(g[128:132], gathered[0][128:132]) for g in gathered),
                checkpoint_same=torch.equal(w1.grad, w2.grad), unsynced=unsynced)


def test_fp32_sequence_dim_1_every_mode_micro_batch_1_and_2_tp3():
    for per_rank in _ws3():
        for key, err in per_rank.items():
            assert err <= 1e-5, (key, err)


def test_precision_layouts_checkpointing_and_dropout_tp2():
    for out in _ws2():
        for key, err in out["fp32"].items():
            assert err <= 1e-5, ("fp32", key, err)
        for key, err in {**out["bf16 autocast"], **out["bf16 params"]}.items():
            assert err <= BF16_TOL, ("bf16", key, err)
        assert out["bf16 autocast + checkpoint"] <= BF16_TOL
        for key, err in out["fp16 autocast"].items():
            assert err <= FP16_TOL, ("fp16", key, err)
        for key, err in {**out["checkpoint"], **out["torch.compile"]}.items():
            assert err <= 1e-5, ("checkpoint", key, err)
        assert "a partial product is torch.bfloat16" in out["partial of another dtype"]
        d = out["dropout"]
        assert d["replicated_same"] and d["sharded_differ"] and d["after_same"] and d["checkpoint_same"], d
        assert "default_generator_state differs" in d["unsynced"]
