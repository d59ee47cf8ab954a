"""`parallelize` at TP size 1: plain parameters, so the compiled step is the plain model's step.

One rank has nothing to split or sum, and a DTensor parameter would only cost host time (a
compiled graph unwraps and re-wraps each one every step; AdamW and `clip_grad_norm_` dispatch
through DTensor per op). At tp 1 every parameter is a plain tensor: the parallelized HF Llama
compiles (fullgraph, aot_eager) into one graph with exactly the plain model's graph inputs, and a
training step (loss, every gradient, clip_grad_norm_'s norm, foreach AdamW's new parameters) equals
the plain model's, eager and compiled, in every overlap mode. The state dict still gives the TP
layers' parameters as DTensors on the 1-rank mesh, and a DCP checkpoint saves and loads back
bit-equal.
"""

import copy

import pytest
import torch

from distributed import distributed

pytest.importorskip("transformers")


class _Counting:
    """A backend that keeps the graphs dynamo hands it (and runs them with aot_eager)."""

    def __init__(self) -> None:
        self.inputs: list[int] = []

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend

        self.inputs.append(len(example_inputs))
        return lookup_backend("aot_eager")(gm, example_inputs)


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _train_step(model, ids):
    """(loss, grads, total norm, parameters after the step) of one user step: clip, foreach AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    opt.step()
    return float(loss), grads, float(norm), [p.detach().clone() for p in model.parameters()]


@distributed(world_size=1, timeout_s=300)
def _tp1(path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers import LlamaConfig, LlamaForCausalLM

    import overlapkit

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=32, max_position_embeddings=32, attn_implementation="sdpa",
                      use_cache=False)
    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    out = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        plain_backend = _Counting()
        plain = copy.deepcopy(ref)
        expected = _train_step(torch.compile(plain, fullgraph=True, backend=plain_backend) if compiled else plain, ids)
        for mode in ("none", "bulk", "pipelined", "auto"):
            torch._dynamo.reset()
            model = overlapkit.parallelize(copy.deepcopy(ref), mesh, overlap=mode)
            dtensors = sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor))
            backend = _Counting()
            got = _train_step(torch.compile(model, fullgraph=True, backend=backend) if compiled else model, ids)
            err = max([abs(got[0] - expected[0]) / abs(expected[0]), abs(got[2] - expected[2]) / expected[2]]
                      + [_rel(a, b) for a, b in zip(got[1], expected[1])] + [_rel(a, b) for a, b in zip(got[3], expected[3])])
            out[(compiled, mode)] = dict(dtensors=dtensors, err=err, graphs=backend.inputs,
                                         plain_graphs=plain_backend.inputs)
    # DCP: the TP layers' entries are DTensors on the 1-rank mesh, the rest plain; a round trip is bit-equal.
    model = overlapkit.parallelize(copy.deepcopy(ref), mesh)
    sd = model.state_dict()
    out["sd_dtensor"] = isinstance(sd["model.layers.0.self_attn.q_proj.weight"], DTensor)
    dcp.save(sd, checkpoint_id=path)
    saved = {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in sd.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=path)
    model.load_state_dict(sd)
    now = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in model.state_dict().items()}
    out["dcp_equal"] = all(torch.equal(now[k], saved[k]) for k in saved)
    return out


def test_tp1_parameters_are_plain_and_the_step_equals_the_plain_models(tmp_path):
    out = _tp1(str(tmp_path / "ckpt"))[0]
    for compiled in (False, True):
        for mode in ("none", "bulk", "pipelined", "auto"):
            r = out[(compiled, mode)]
            where = f"compiled={compiled}, overlap={mode}"
            assert r["dtensors"] == [], f"{where}: DTensor parameters at tp 1: {r['dtensors']}"
            assert r["err"] <= 1e-5, f"{where}: differs from the plain model by {r['err']:.2e}"
            if compiled:  # one graph, fed exactly what the plain model's graph is fed
                assert r["graphs"] == r["plain_graphs"] and len(r["graphs"]) == 1, \
                    f"{where}: graphs with {r['graphs']} inputs, the plain model's {r['plain_graphs']}"
    assert out["sd_dtensor"] and out["dcp_equal"]
