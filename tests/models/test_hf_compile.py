"""torch.compile(fullgraph=True) of a parallelized HF Llama trained with `labels=`: one graph, eager's numbers.

Whole model, and per decoder block, for every overlap mode with sequence parallelism (and none/bulk
without), tp 2: the loss and every parameter gradient of the compiled step equal the eager step's
(fp32, rel 1e-5), and dynamo hands the backend exactly one forward graph (per block: one per block, and under sequence
parallelism one for the region-entry hook of the first block, a frame of its own under Module.compile), and
nothing more at the second step (no recompile: the norms' gradient sums are hooks registered before tracing).
The backend is "aot_eager" (dynamo + AOT autograd, where a break or a missing fake kernel shows;
inductor's code generation on shared cores costs minutes per model). The vocabulary-parallel
embedding, the layers' collectives and the loss's all-reduces are custom ops inside the graph.
Compiled, the returned logits are this rank's vocabulary columns as a plain tensor (a compiled
DTensor output that no gradient reaches fails in backward: PyTorch #173123); the loss is the same.
"""

import copy

import pytest
import torch

from distributed import distributed

pytest.importorskip("transformers")

CASES = [("none", True), ("bulk", True), ("pipelined", True), ("auto", True), ("none", False), ("bulk", False)]


class _Counting:
    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        from torch._dynamo.backends.registry import lookup_backend
        return lookup_backend("aot_eager")(gm, example_inputs)


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _step(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = [_local(p.grad).clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return float(loss), grads


def _cases():
    import overlapkit
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM

    tp = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=32, max_position_embeddings=32, attn_implementation="sdpa",
                      use_cache=False)  # training: a KV cache would make each block's guards differ
    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 32, (2, 4 * tp), generator=torch.Generator().manual_seed(1))
    out = {}
    for how in ("model", "blocks"):
        for mode, sp in [(None, None)] + CASES:
            torch._dynamo.reset()
            model = copy.deepcopy(ref)
            if mode is not None:  # (None, None): the plain model, whose graph count is the expectation
                overlapkit.parallelize(model, mesh, overlap=mode, sequence_parallel=sp)
            loss_e, grads_e = _step(model, ids)
            backend = _Counting()
            if how == "model":
                compiled = torch.compile(model, fullgraph=True, backend=backend)
            else:
                for block in model.model.layers:
                    block.compile(fullgraph=True, backend=backend)
                compiled = model
            loss_c, grads_c = _step(compiled, ids)
            graphs = backend.graphs
            _step(compiled, ids)  # the second step runs what the first compiled: nothing traced changed
            err = max([abs(loss_c - loss_e) / abs(loss_e)] + [_rel(c, e) for c, e in zip(grads_c, grads_e)])
            out[(how, mode, sp)] = dict(graphs=graphs, recompiled=backend.graphs - graphs, err=err)
    return out


@distributed(world_size=2, timeout_s=300)
def _tp2():
    return _cases()


def test_compiled_hf_llama_with_labels_is_one_graph_and_equals_eager():
    for rank, out in enumerate(_tp2()):
        for (how, mode, sp), r in out.items():
            where = f"rank {rank}: compile per {how}, mode={mode}, sp={sp}"
            # The whole model: one graph. Per block: one per block (a plain model's identical blocks
            # share one; ours differ by their layers' names), plus, under sequence parallelism, the
            # first block's region-entry hook, which Module.compile traces as a frame of its own.
            if how == "model":
                assert r["graphs"] == 1, f"{where}: {r['graphs']} graphs"
            else:
                assert 1 <= r["graphs"] <= 2 + bool(sp), f"{where}: {r['graphs']} graphs for 2 blocks"
            assert r["recompiled"] == 0, f"{where}: the second step compiled {r['recompiled']} graph(s) again"
            assert r["err"] <= 1e-5, f"{where}: compiled differs from eager by {r['err']:.2e}"
