"""`generate()` on a model made tensor parallel by overlapkit.parallelize gives the unsharded model's tokens.

HF LlamaForCausalLM from a tiny config, greedy decoding with the KV cache, a batch of two prompts
left-padded to one length, every overlap mode, sequence parallelism on (the plan's default) and
off, at tp 2 and 3. The prompt's length splits over the ranks, so prefill runs sequence parallel;
every decode step has one token, which does not: sequence parallelism steps aside by itself for
those forwards (no flag), and the output head hands `generate()` whole-vocabulary logits. Also:
a forward with gradients on a sequence that does not split still fails, naming the length, on
every rank; and inference without labels returns whole logits, as the plain model does.
"""

import copy

import pytest
import torch

from distributed import distributed

pytest.importorskip("transformers")

MODES = ("none", "bulk", "pipelined", "auto")


def _model(tp: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=8 * 2 * tp, intermediate_size=32 * tp, num_hidden_layers=2,
                      num_attention_heads=2 * tp, num_key_value_heads=tp, vocab_size=32 * tp,
                      max_position_embeddings=64, attn_implementation="sdpa", pad_token_id=0)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def _prompts(tp: int):
    g = torch.Generator().manual_seed(3)
    length = 2 * tp  # splits over tp ranks: prefill runs sequence parallel
    ids = torch.randint(1, 32 * tp, (2, length), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :tp], mask[1, :tp] = 0, 0  # the second prompt is shorter: left padding
    return ids, mask


def _cases():
    import overlapkit
    from torch.distributed.device_mesh import init_device_mesh

    tp = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    ref = _model(tp)
    ids, mask = _prompts(tp)
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, use_cache=True, pad_token_id=0)
    expected = ref.generate(ids, **kw)
    out = {}
    for mode in MODES:
        for sp in (True, False) if mode in ("none", "bulk") else (True,):
            model = overlapkit.parallelize(copy.deepcopy(ref), mesh, overlap=mode, sequence_parallel=sp)
            got = model.generate(ids, **kw)
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=mask).logits
                ref_logits = ref(input_ids=ids, attention_mask=mask).logits
            out[(mode, sp)] = dict(tokens=torch.equal(got, expected), new=got.shape[1] - ids.shape[1],
                                   whole_logits=type(logits) is torch.Tensor and logits.shape == ref_logits.shape,
                                   logits_err=(logits - ref_logits).abs().max().item())
    model = overlapkit.parallelize(copy.deepcopy(ref), mesh, overlap="none")
    try:
        odd = torch.randint(1, 32, (1, 2 * tp + 1))
        model(input_ids=odd, labels=odd).loss.backward()
        out["odd_with_grad"] = None
    except ValueError as e:
        out["odd_with_grad"] = str(e)
    return out


@distributed(world_size=2)
def _tp2():
    return _cases()


@distributed(world_size=3)
def _tp3():
    return _cases()


@pytest.mark.parametrize("tp", [2, 3])
def test_generate_gives_the_unsharded_models_tokens(tp):
    for rank, out in enumerate((_tp2 if tp == 2 else _tp3)()):
        for key, r in out.items():
            if key == "odd_with_grad":
                assert r is not None and "not divisible" in r and "sequence length" in r, r
                continue
            where = f"tp={tp} rank {rank} mode={key[0]} sp={key[1]}"
            assert r["new"] == 5, where
            assert r["tokens"], f"{where}: generated tokens differ from the unsharded model's"
            assert r["whole_logits"], f"{where}: inference without labels should return whole plain logits"
            assert r["logits_err"] < 1e-5, f"{where}: logits off by {r['logits_err']}"
