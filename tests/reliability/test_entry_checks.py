"""Inputs checked at a parallel model's door, and every rank told why a step broke.

One world of 2 gloo ranks runs every probe, each on its own group with a 3 s timeout; each probe's
outcome on each rank comes back by name, so a failure says which probe. A probe passes when every
rank raises a RankMismatchError naming what differs (or the rank and what it skipped) within the
timeout + 5 s, or, for the control probes, when every rank returns the same numbers.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

from distributed import distributed
from overlapkit.launch import free_port

TIMEOUT_S = 3.0
MARGIN_S = 5.0


def _group():
    return dist.new_group([0, 1], timeout=datetime.timedelta(seconds=TIMEOUT_S))


def _tp(ids_on_rank1: str):
    from overlapkit.models import GPT, GPTConfig, parallelize
    from overlapkit.models.gpt import lm_loss

    torch.manual_seed(0)
    model = parallelize(GPT(GPTConfig()), _group(), overlap="none")
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(5))
    if dist.get_rank() == 1 and ids_on_rank1 == "shorter":
        ids = ids[:, :8]
    if dist.get_rank() == 1 and ids_on_rank1 == "other ids":
        ids = (ids + 1) % 64
    return lm_loss(model(ids), ids).item()


def _hf(labels_on_rank1: str):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models"))
    from hf_families import build
    from overlapkit.models import parallelize

    model = parallelize(build("llama", 2), _group(), overlap="none")
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(5))
    labels = ids.clone()
    if dist.get_rank() == 1 and labels_on_rank1 == "shorter":
        ids, labels = ids[:, :8], labels[:, :8]
    if dist.get_rank() == 1 and labels_on_rank1 == "other labels":
        labels = labels.flip(1)
    return model(input_ids=ids, labels=labels).loss.item()


def _mode_switched_on_rank1():
    from overlapkit.tensor_parallel import ColumnParallelLinear

    torch.manual_seed(0)
    col = ColumnParallelLinear(8, 8, _group(), overlap="pipelined", chunks=2, sequence_parallel=True)
    x = torch.randn(4, 8)
    col(x)
    if dist.get_rank() == 1:
        col.overlap = "bulk"  # refused here (chunks=2 is pipelined's): rank 0 must hear why rank 1 left
    return col(x).sum().item()


def _dp(engine: str, skip: str, digest_every: int = 0):
    from overlapkit.data_parallel import DataParallel, ShardedOptimizer, fully_shard

    group, rank = _group(), dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    if engine == "fully_shard":
        model = fully_shard(net, group, prefetch=1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        model = DataParallel(net, group)
        model.progress.digest_every = digest_every
        opt = (ShardedOptimizer(model, torch.optim.SGD, group, lr=0.1, overlap_param_gather=False)
               if engine == "ShardedOptimizer" else torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(4, 5) + rank, torch.randn(4, 3)
    for step in range(3):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        if not (rank == 1 and step == 1 and skip == "backward"):
            loss.backward()
        if not (rank == 1 and step == 1 and skip == "step"):
            opt.step()
        if rank == 1 and step == 0 and skip == "weights by hand":
            with torch.no_grad():
                net[0].weight.add_(1e-3)
    return loss.item()


PROBES = {
    "TP, same batch": (lambda: _tp("same"), None),
    "TP, [2, 12] vs [2, 8]": (lambda: _tp("shorter"), ["argument 0 differs", "[2, 12] torch.int64", "[2, 8] torch.int64"]),
    "TP, other ids of one shape": (lambda: _tp("other ids"), ["argument 0 values differs"]),
    "HF Llama TP, same batch": (lambda: _hf("same"), None),
    "HF Llama TP, [2, 12] vs [2, 8]": (lambda: _hf("shorter"), ["input_ids differs", "[2, 8] torch.int64"]),
    "HF Llama TP, other labels": (lambda: _hf("other labels"), ["labels values differs"]),
    "TP layer, overlap='bulk' refused on rank 1 only": (_mode_switched_on_rank1, ["overlap='bulk' refused"]),
    "DataParallel, no skip": (lambda: _dp("DataParallel", ""), None),
    "DataParallel, rank 1 skips step()": (lambda: _dp("DataParallel", "step"), ["optimizer steps differs (rank 0: 2, rank 1: 1)"]),
    "DataParallel, rank 1 skips backward()": (lambda: _dp("DataParallel", "backward"), ["rank 1", "entry of its next forward", "skipped"]),
    "DataParallel, weights changed by hand": (lambda: _dp("DataParallel", "weights by hand", digest_every=1), ["parameter digest differs"]),
    "ShardedOptimizer, rank 1 skips backward()": (lambda: _dp("ShardedOptimizer", "backward"), ["rank 1 without a backward()"]),
    "ShardedOptimizer, rank 1 skips step()": (lambda: _dp("ShardedOptimizer", "step"), ["rank 1", "skipped"]),
    "fully_shard, rank 1 skips backward()": (lambda: _dp("fully_shard", "backward"), ["rank 1", "entry of its next forward"]),
    "fully_shard, rank 1 skips step()": (lambda: _dp("fully_shard", "step"), ["optimizer steps differs"]),
}


@distributed(world_size=2, timeout_s=30.0)
def _run_probes() -> dict:
    out = {}
    for name, (probe, _) in PROBES.items():
        t0 = time.monotonic()
        try:
            out[name] = ("returned", probe(), time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - what each rank raised is the result
            out[name] = (type(e).__name__, str(e), time.monotonic() - t0)
        dist.barrier()  # a rank that failed first waits for the other before the next probe's group
    return out


def test_every_probe_fails_on_every_rank_naming_why_or_agrees():
    ranks = _run_probes()
    bad = []
    for name, (_, expect) in PROBES.items():
        got = [r[name] for r in ranks]
        if expect is None:
            # TP ranks share one batch (one loss); DP ranks each score their own rows.
            if any(g[0] != "returned" for g in got) or (name.startswith("TP") and got[0][1] != got[1][1]):
                bad.append(f"{name}: expected a result on both ranks (the same under TP), got {got}")
            continue
        for rank, (kind, text, took) in enumerate(got):
            own = kind == "ValueError" and "refused" in name  # the rank that misused says so in its own words
            if (kind != "RankMismatchError" and not own) or took > TIMEOUT_S + MARGIN_S:
                bad.append(f"{name}: rank {rank} {kind} after {took:.1f} s: {text[:300]}")
        # The rank that went astray says it; its peer names it (every probe's words on at least one rank, the
        # differing values on every rank).
        joined = " | ".join(g[1] for g in got)
        for words in expect:
            if words not in joined:
                bad.append(f"{name}: no rank's message says {words!r}: {joined[:600]}")
    assert not bad, "\n".join(bad)


# -- context parallel at 4 ranks (the case: two of four used to time out unnamed) ------------

@distributed(world_size=4, timeout_s=30.0)
def _cp_one_rank_shorter():
    from overlapkit.context_parallel.batch import shard_batch
    from overlapkit.models import GPT, GPTConfig
    from overlapkit.models.ring_attention import apply_to_gpt

    group = dist.new_group(list(range(4)), timeout=datetime.timedelta(seconds=TIMEOUT_S))
    torch.manual_seed(0)
    model = apply_to_gpt(GPT(GPTConfig(seq_len=32)), group)
    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    t0 = time.monotonic()
    try:
        for step in range(2):  # the same first step everywhere, then rank 2's slice is shorter
            local = shard_batch(ids, group)[0]
            model(local[:, :4] if dist.get_rank() == 2 and step == 1 else local).sum().backward()
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        return type(e).__name__, str(e), time.monotonic() - t0
    return "returned", "", time.monotonic() - t0


def test_context_parallel_one_rank_of_four_shorter_fails_on_all_four_naming_it():
    for rank, (kind, text, took) in enumerate(_cp_one_rank_shorter()):
        assert kind == "RankMismatchError" and "rank 2: '[2, 4] torch.int64'" in text, (rank, kind, text)
        assert took <= TIMEOUT_S + MARGIN_S, (rank, took)


# -- the store's host leaves first (mp.spawn / env://): its peer still hears why ----------------

def _host_leaves(rank: int, port: int, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", "env://", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    from overlapkit.runtime import comm
    from overlapkit.runtime.agreement import report_problem

    t0 = time.monotonic()
    if rank == 0:  # the store's host finds a misuse on its own, says so, and exits with the error
        report_problem(dist.group.WORLD, "probe", "rank 0 refused its input: a local misuse")
        raise SystemExit(1)
    try:
        comm.all_reduce(torch.ones(4), dist.group.WORLD, kind="dp_all_reduce", name="x").wait()
        text = "returned"
    except Exception as e:  # noqa: BLE001
        text = f"{type(e).__name__}: {e}"
    with open(path, "w") as f:
        f.write(f"{time.monotonic() - t0:.1f}\n{text}")


def test_the_store_host_leaving_first_still_tells_its_peer(tmp_path):
    path = str(tmp_path / "rank1.txt")
    ctx = mp.start_processes(_host_leaves, args=(free_port(), path), nprocs=2, join=False, start_method="spawn")
    for p in ctx.processes:
        p.join(60)
    took, text = open(path).read().split("\n", 1)
    assert "rank 0 refused its input: a local misuse" in text, text
    assert float(took) <= TIMEOUT_S + MARGIN_S, took


def _agree_then_leave(rank: int, port: int, folder: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", "env://", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    from overlapkit.runtime.agreement import agree

    if rank == 1:
        time.sleep(1.0)  # the store's host has both signatures first, raises and would exit before rank 1 reads
    try:
        agree(dist.group.WORLD, "MoE", num_experts=4 + rank)
    except Exception as e:
        with open(os.path.join(folder, f"rank{rank}.txt"), "w") as f:
            f.write(f"{type(e).__name__}: {e}")
        raise


def test_under_mp_spawn_every_rank_raises_the_named_mismatch(tmp_path):
    # mp.spawn's parent terminates the other ranks once one exits with an error: the host must wait.
    with pytest.raises(Exception, match="num_experts differs"):
        mp.spawn(_agree_then_leave, args=(free_port(), str(tmp_path)), nprocs=2)
    for rank in range(2):
        text = (tmp_path / f"rank{rank}.txt").read_text()
        assert text.startswith("RankMismatchError: MoE: ranks [0, 1]") and "rank 1: 5" in text, (rank, text)
