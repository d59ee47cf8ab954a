"""TP layers and the parallel GPT on CUDA over NCCL, one rank per GPU (world size 1 on one GPU)."""

import torch
import torch.distributed as dist

from distributed import distributed
from models.test_parallel_gpt import _gpt_errors
from tensor_parallel.test_layers import RTOL, _configs, check_layer


def _on_cuda(fn, *args):
    torch.set_default_device(f"cuda:{torch.cuda.current_device()}")
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference check is fp32-exact
    try:
        return fn(*args)
    finally:
        torch.set_default_device(None)


@distributed(world_size=None, backend="nccl", timeout_s=120)
def _layers_nccl(seed):
    ws = dist.get_world_size()
    return [(c, _on_cuda(check_layer, c, dist.group.WORLD)) for c in _configs(ws, seed)]


def test_layers_on_nccl():
    for rank_results in _layers_nccl(11):
        for cfg, err in rank_results:
            assert err <= RTOL, (cfg, err)


@distributed(world_size=None, backend="nccl", timeout_s=120)
def _gpt_nccl():
    cases = [(sp, ov) for sp in (False, True) for ov in ("none", "bulk", "auto")] + [(True, "pipelined")]
    return {(sp, ov): _on_cuda(_gpt_errors, sp, ov) for sp, ov in cases}


def test_parallel_gpt_on_nccl():
    for per_rank in _gpt_nccl():
        for key, err in per_rank.items():
            assert err <= 1e-5, (key, err)
