"""DataParallel gradients equal one process on the whole batch, and PyTorch DDP's, over 2 and 3 ranks."""

import pytest

from dp_cases import BUCKETS, results

WORLDS = [2, 3]
TOL = 1e-5


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("buckets", list(BUCKETS))
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("peer", ["single process", "DDP"])
def test_grads_match(world, buckets, overlap, peer):
    for r in results(world):
        assert r[f"vs {peer}, {buckets}, overlap={overlap}"] <= TOL, r


@pytest.mark.parametrize("world", WORLDS)
def test_bucket_sizes_span_one_param_per_bucket_to_one_bucket(world):
    r = results(world)[0]
    assert r["buckets, one param per bucket"] == 6  # the MLP has 6 parameters
    assert 1 < r["buckets, a few buckets"] < 6
    assert r["buckets, one bucket"] == 1


@pytest.mark.parametrize("world", WORLDS)
def test_no_sync_accumulates_then_reduces_once(world):
    for r in results(world):
        assert r["no_sync vs k-times batch"] <= TOL, r
        assert r["no_sync reductions"] == 1, r  # only the last micro-batch communicated


@pytest.mark.parametrize("world", WORLDS)
def test_grad_reduce_dtype(world):
    for r in results(world):
        assert r["bf16 reduce bytes per element"] == 2.0, r
        assert r["bf16 reduce vs fp32 single process"] <= 1e-2, r  # bf16 keeps ~3 significant digits
        assert r["fp32 reduce bytes per element"] == 4.0, r
        assert r["fp32 reduce of bf16 grads vs fp32 average"] <= 1e-2, r


@pytest.mark.parametrize("world", WORLDS)
def test_tied_weight_reduced_once(world):
    for r in results(world):
        assert r["tied vs single process"] <= TOL, r
        assert r["tied params in buffer"] == 3, r  # emb/head weight once, mid weight, mid bias
        assert r["tied reduced elements"] == r["tied buffer elements"], r
