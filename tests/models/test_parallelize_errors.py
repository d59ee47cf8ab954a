"""overlapkit.parallelize refuses bad input on every rank, with one message naming the values, never a hang."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed import distributed

pytest.importorskip("transformers")


def _message(fn):
    try:
        fn()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@distributed(world_size=2, timeout_s=90)
def _errors():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from transformers import LlamaConfig, LlamaForCausalLM

    from overlapkit import parallelize
    from overlapkit.models import GPT, GPTConfig
    from overlapkit.tensor_parallel import ColwiseParallel

    tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    dp = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    cfg = GPTConfig(vocab_size=16, seq_len=8, hidden=16, num_heads=2, ffn_hidden=16)
    llama_cfg = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2, vocab_size=32, max_position_embeddings=16)

    def wrong_mesh():
        gpt = GPT(cfg)
        gpt.head.weight = nn.Parameter(distribute_tensor(gpt.head.weight.detach(), dp, [Replicate()]))
        parallelize(gpt, tp)

    def seq_not_divisible():
        model = parallelize(LlamaForCausalLM(LlamaConfig(**llama_cfg)), tp, sequence_parallel=True)
        model(input_ids=torch.zeros(1, 7, dtype=torch.long))

    def mismatch():
        parallelize(GPT(cfg), tp, overlap="bulk" if dist.get_rank() == 1 else "none")

    out = {
        "no_tp": _message(lambda: parallelize(GPT(cfg), dp)),
        "plan_key": _message(lambda: parallelize(GPT(cfg), tp, plan={"blocks.*.nothing": ColwiseParallel()})),
        "wrong_mesh": _message(wrong_mesh),
        "seq": _message(seq_not_divisible),
        "kv_heads": _message(lambda: parallelize(
            LlamaForCausalLM(LlamaConfig(**{**llama_cfg, "num_key_value_heads": 1})), tp)),
        "unknown_model": _message(lambda: parallelize(nn.Linear(2, 2), tp)),
        "plan_and_overlap": _message(lambda: parallelize(GPT(cfg), tp, overlap="bulk", plan={})),
        "mismatch": _message(mismatch),
        "gpt_vocab": _message(lambda: parallelize(GPT(GPTConfig(vocab_size=9, seq_len=4, hidden=16, num_heads=2,
                                                                  ffn_hidden=8)), tp)),
    }
    return out


def test_bad_input_fails_alike_on_every_rank_naming_values():
    per_rank = _errors()
    assert per_rank[0] == per_rank[1]
    got = per_rank[0]
    assert "the DeviceMesh has dims ('dp',) of sizes (2,); tensor parallelism needs a dim named 'tp'" in got["no_tp"]
    assert "plan key 'blocks.*.nothing' names no module of GPT" in got["plan_key"]
    assert "parameter 'weight' of Linear is a DTensor on DeviceMesh" in got["wrong_mesh"]
    assert "(dp=2)" in got["wrong_mesh"] and "not on the tensor-parallel mesh" in got["wrong_mesh"]
    assert "model.layers.0: sequence length (dim 1) 7 is not divisible by the tensor-parallel size 2" in got["seq"]
    assert "LlamaConfig.num_key_value_heads=1 is not divisible by the tensor-parallel size 2" in got["kv_heads"]
    assert "no built-in plan for torch.nn.modules.linear.Linear" in got["unknown_model"]
    assert "with plan= the styles carry their own options; got also {'overlap': 'bulk'}" in got["plan_and_overlap"]
    assert got["gpt_vocab"] == "ValueError: GPTConfig.vocab_size=9 is not divisible by the tensor-parallel size 2"
    assert got["mismatch"].startswith("RankMismatchError: parallelize: ranks [0, 1] were given different "
                                      "configurations: plan differs")
