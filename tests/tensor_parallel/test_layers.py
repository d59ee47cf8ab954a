"""Column/Row parallel layers against the unsharded nn.Linear: outputs and every gradient."""

import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed import distributed
from overlapkit.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

RTOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def scaled_err(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> float:
    """Largest |a - b| relative to the sum of the magnitudes of the terms that made b.

    Each element of an output or gradient is a sum (over tokens or features); when its terms
    cancel, the sum is tiny and its own size is no yardstick for rounding (a bias gradient of
    0.005 summed from twelve O(1) terms carries ~1e-7 of fp32 rounding either way). Relative to
    the sum of |terms| the error of any correct reduction order is ~n·2^-24, far below RTOL; a
    wrong sharding or a missing reduction is O(1)."""
    return ((a - b).abs() / scale.clamp_min(1e-30)).max().item()


def _configs(ws: int, seed: int):
    rng = random.Random(seed)
    for kind in ("column", "row"):
        for sp in (False, True):
            for overlap in ("none", "bulk"):
                for bias in (False, True):
                    for ndim in (2, 3):
                        s = ws * rng.randint(1, 3)
                        shape = (s, rng.randint(1, 2)) if ndim == 3 else (s,)
                        yield dict(kind=kind, sp=sp, overlap=overlap, bias=bias, lead=shape,
                                   fin=ws * rng.randint(1, 4), fout=ws * rng.randint(1, 4))


def check_layer(cfg, group) -> float:
    """Largest error of output and grads of one parallel layer vs nn.Linear (see scaled_err)."""
    ws, r = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(1234)  # same full layer and data on every rank
    full = nn.Linear(cfg["fin"], cfg["fout"], bias=cfg["bias"])
    X = torch.randn(*cfg["lead"], cfg["fin"], requires_grad=True)
    G = torch.randn(*cfg["lead"], cfg["fout"])
    Y = full(X)
    (Y * G).sum().backward()
    # The same products with every term made positive: their sums are the error yardsticks.
    absf = nn.Linear(cfg["fin"], cfg["fout"], bias=cfg["bias"])
    with torch.no_grad():
        absf.weight.copy_(full.weight.abs())
        if cfg["bias"]:
            absf.bias.copy_(full.bias.abs())
    Xa = X.detach().abs().requires_grad_(True)
    Ya = absf(Xa)
    (Ya * G.abs()).sum().backward()

    sp = cfg["sp"]
    if cfg["kind"] == "column":
        layer = ColumnParallelLinear.from_full(full, group, sequence_parallel=sp, overlap=cfg["overlap"])
        x = X.detach().chunk(ws, 0)[r] if sp else X.detach()
        y_ref, y_scale = Y.detach().chunk(ws, -1)[r], Ya.detach().chunk(ws, -1)[r]
        g = G.chunk(ws, -1)[r]
        dx_ref, dx_scale = (X.grad.chunk(ws, 0)[r], Xa.grad.chunk(ws, 0)[r]) if sp else (X.grad, Xa.grad)
    else:
        layer = RowParallelLinear.from_full(full, group, sequence_parallel=sp, overlap=cfg["overlap"])
        x = X.detach().chunk(ws, -1)[r]
        y_ref, y_scale = (Y.detach().chunk(ws, 0)[r], Ya.detach().chunk(ws, 0)[r]) if sp else (Y.detach(), Ya.detach())
        g = G.chunk(ws, 0)[r] if sp else G
        dx_ref, dx_scale = X.grad.chunk(ws, -1)[r], Xa.grad.chunk(ws, -1)[r]
    x = x.clone().requires_grad_(True)
    y = layer(x)
    (y * g).sum().backward()  # no call after backward: the row bias gradient is complete by itself
    errs = [scaled_err(y, y_ref, y_scale), scaled_err(x.grad, dx_ref, dx_scale),
            scaled_err(layer.weight.grad.to_local(), layer.shard_of(full.weight.grad),
                       layer.shard_of(absf.weight.grad))]
    if cfg["bias"]:
        errs.append(scaled_err(layer.bias.grad.to_local(), layer.shard_of(full.bias.grad),
                               layer.shard_of(absf.bias.grad)))
    return max(errs)


@distributed(world_size=1)
def _run1(seed):
    return [(c, check_layer(c, dist.group.WORLD)) for c in _configs(1, seed)]


@distributed(world_size=2)
def _run2(seed):
    return [(c, check_layer(c, dist.group.WORLD)) for c in _configs(2, seed)]


@distributed(world_size=3)
def _run3(seed):
    return [(c, check_layer(c, dist.group.WORLD)) for c in _configs(3, seed)]


@distributed(world_size=4)
def _run4(seed):
    return [(c, check_layer(c, dist.group.WORLD)) for c in _configs(4, seed)]


@pytest.mark.parametrize("run", [_run1, _run2, _run3, _run4], ids=["tp1", "tp2", "tp3", "tp4"])
def test_layers_match_unsharded(run):
    seed = random.randrange(2**31)  # shapes drawn per run; the seed is in the failure message
    for rank_results in run(seed):
        assert len(rank_results) == 32
        for cfg, err in rank_results:
            assert err <= RTOL, f"seed={seed} {cfg}: rel err {err:.2e}"


@distributed(world_size=2)
def _bad_inputs():
    group = dist.group.WORLD
    msgs = []
    cases = [
        lambda: ColumnParallelLinear(4, 5, group),
        lambda: RowParallelLinear(5, 4, group),
        lambda: ColumnParallelLinear(4, 4, group, overlap="fast"),
        lambda: ColumnParallelLinear(4, 4, group)(torch.randn(3, 5)),
        lambda: ColumnParallelLinear(4, 4, group)(torch.randn(3, 4, dtype=torch.float64)),
        lambda: RowParallelLinear(4, 4, group, sequence_parallel=True)(torch.randn(3, 2)),
    ]
    for case in cases:
        try:
            case()
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    dist.barrier()  # every rank got here: nobody hangs in a collective
    return msgs


def test_bad_inputs_fail_on_every_rank_with_the_sizes():
    out = _bad_inputs()
    assert out[0] == out[1]
    m = out[0]
    assert m[0] == "ColumnParallelLinear: out_features 5 is not divisible by the tensor-parallel size 2"
    assert m[1] == "RowParallelLinear: in_features 5 is not divisible by the tensor-parallel size 2"
    assert m[2] == "overlap='fast' is not one of ('none', 'bulk', 'pipelined', 'auto')"
    assert m[3] == "ColumnParallelLinear: input's last dim is 5, expected 4"
    assert "dtype torch.float64 differs from the weight dtype torch.float32" in m[4]
    assert m[5] == "RowParallelLinear: sequence length (dim 0) 3 is not divisible by the tensor-parallel size 2"
