"""torch.compile(fullgraph=True) over blocks built of overlapkit's TP layers: one graph, the same numbers as eager.

On 2 gloo ranks, a TP+SP MLP and a GPT block (qkv/proj/fc1/fc2 parallel, SP layer norms) for
every overlap mode. Each model is compiled once, with a counting backend over "aot_eager"
(dynamo and AOT autograd, which is where a graph break or a missing fake kernel would show;
inductor's code generation on 2 shared cores costs ~40 s per model, so it runs for one case:
the pipelined MLP). `fullgraph=True` raises on any break; the counter also checks that exactly
one forward graph was made. Forward output, input gradient and every parameter gradient must
equal eager's (rel 1e-5); the timeline recorder must still see the transfers of the compiled run
(the ops' bodies run eagerly).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distributed import distributed
from overlapkit.models.gpt import Block, GPTConfig
from overlapkit.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from overlapkit.tensor_parallel.sequence_parallel import mark_sequence_parallel
from overlapkit.runtime.recorder import record

MODES = ("none", "bulk", "pipelined", "auto")
RTOL = 1e-5


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


class _Counting:
    """A torch.compile backend that counts the graphs dynamo hands it, then runs aot_eager or inductor."""

    def __init__(self, inner: str) -> None:
        self.graphs, self.inner = 0, inner

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        from torch._dynamo.backends.registry import lookup_backend
        return lookup_backend(self.inner)(gm, example_inputs)


class _MLP(nn.Module):
    def __init__(self, group, overlap: str, **fc1_options) -> None:
        super().__init__()
        kw = dict(sequence_parallel=True, overlap=overlap)
        self.fc1 = ColumnParallelLinear(8, 16, group, name="fc1", **kw, **fc1_options)
        self.fc2 = RowParallelLinear(16, 8, group, name="fc2", **kw)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _block(group, overlap: str) -> nn.Module:
    torch.manual_seed(5)
    blk = Block(GPTConfig(vocab_size=16, seq_len=8, hidden=8, num_heads=2, ffn_hidden=16, num_layers=1))
    kw = dict(sequence_parallel=True, overlap=overlap)
    blk.attn.qkv = ColumnParallelLinear.from_full(blk.attn.qkv, group, name="qkv", **kw)
    blk.attn.proj = RowParallelLinear.from_full(blk.attn.proj, group, name="proj", **kw)
    blk.mlp.fc1 = ColumnParallelLinear.from_full(blk.mlp.fc1, group, name="fc1", **kw)
    blk.mlp.fc2 = RowParallelLinear.from_full(blk.mlp.fc2, group, name="fc2", **kw)
    mark_sequence_parallel(blk.ln1, group)
    mark_sequence_parallel(blk.ln2, group)
    return blk


def _grads(model, x):
    return [x.grad.clone()] + [_local(p.grad).clone() for p in model.parameters()]


def _compare(model: nn.Module, x: torch.Tensor, inner: str) -> dict:
    """Eager step, then a compiled step of the same model on the same input: graphs, max rel error, spans."""
    x = x.clone().requires_grad_(True)
    y = model(x)
    y.square().sum().backward()
    want_y, want = y.detach().clone(), _grads(model, x)
    model.zero_grad(set_to_none=True)
    x.grad = None
    backend = _Counting(inner)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    with record() as rec:
        yc = compiled(x)
        yc.square().sum().backward()
    got = _grads(model, x)
    kinds = sorted({s.kind for s in rec.spans if s.kind.startswith("tp_")})
    torch._dynamo.reset()
    return dict(graphs=backend.graphs, err=max([_rel(yc, want_y)] + [_rel(a, b) for a, b in zip(got, want)]),
                kinds=kinds)


@distributed(world_size=2, timeout_s=420)
def _world():
    group, ws = dist.group.WORLD, dist.get_world_size()
    out = {}
    for mode in MODES:
        torch.manual_seed(3)
        x = torch.randn(4 // ws, 2, 8)  # [s/tp, b, h]
        out[("mlp", mode)] = _compare(_MLP(group, mode), x, "aot_eager")
        out[("block", mode)] = _compare(_block(group, mode), torch.randn(8 // ws, 2, 8), "aot_eager")
    torch.manual_seed(3)
    out[("mlp inductor", "pipelined")] = _compare(_MLP(group, "pipelined"), torch.randn(2, 2, 8), "inductor")
    # The gathered input kept from forward (save_gathered_input) feeds the backward's wgrad; at one
    # rank (a group of its own) that "gathered" input is x itself, which the op must not return as is.
    single = [dist.new_group([i]) for i in range(ws)][dist.get_rank()]
    for label, g in (("mlp saved", group), ("mlp saved ws1", single)):
        torch.manual_seed(3)
        n = dist.get_world_size(g)
        mlp = _MLP(g, "pipelined", save_gathered_input=True, chunks=2 * n)
        out[(label, "pipelined")] = _compare(mlp, torch.randn(4 // n, 2, 8), "aot_eager")
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results():
    return _world()


@pytest.mark.parametrize("model", ["mlp", "block"])
@pytest.mark.parametrize("mode", MODES)
def test_fullgraph_one_graph_equals_eager(results, model, mode):
    for rank, res in enumerate(results):
        r = res[(model, mode)]
        assert r["graphs"] == 1, f"rank {rank}: {model} overlap={mode} compiled into {r['graphs']} graphs"
        assert r["err"] <= RTOL, f"rank {rank}: {model} overlap={mode} differs from eager by rel {r['err']:.2e}"


@pytest.mark.parametrize("case", ["mlp saved", "mlp saved ws1"])
def test_saved_gathered_input_compiles_and_equals_eager(results, case):
    for rank, res in enumerate(results):
        r = res[(case, "pipelined")]
        assert r["graphs"] == 1 and r["err"] <= RTOL, f"rank {rank}: {case}: {r}"


def test_inductor_pipelined_equals_eager(results):
    for rank, res in enumerate(results):
        r = res[("mlp inductor", "pipelined")]
        assert r["graphs"] == 1 and r["err"] <= RTOL, f"rank {rank}: {r}"


@pytest.mark.parametrize("mode", MODES)
def test_recorder_sees_transfers_inside_compiled_ops(results, mode):
    """The ops' bodies run eagerly, so a compiled step still records its all-gathers and reduce-scatters
    (and the block's layer-norm gradient all-reduce, from mark_sequence_parallel's hooks)."""
    for rank, res in enumerate(results):
        assert res[("mlp", mode)]["kinds"] == ["tp_all_gather", "tp_reduce_scatter"], f"rank {rank}: {res}"
        assert res[("block", mode)]["kinds"] == ["tp_all_gather", "tp_all_reduce", "tp_reduce_scatter"], \
            f"rank {rank}: {res}"
