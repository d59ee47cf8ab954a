"""The torchtitan adapter (overlapkit.integrations.torchtitan) against one process, on gloo ranks.

torchtitan's Llama 3 imports triton, so it cannot be built on a CPU machine; the stand-in below
has exactly its module names (torchtitan 0.3's `Decoder`: tok_embeddings, layers (a ModuleDict
"0", "1", ...), attention.qkv_linear.wqkv (fused, laid out [n_kv, q-per-kv + 2, head_dim]) or
.wq/.wk/.wv, attention.wo, feed_forward.w1/w2/w3, attention_norm, ffn_norm, norm, lm_head) and its
forward: heads reshaped with -1 (TP-local), complex RoPE, causal SDPA with GQA. Checked: the loss
and every gradient at tp 2 and 3 (fused and separate q/k/v) and at tp 2 x fsdp 2 through
`parallelize_llama3` with torchtitan's signature, from a meta-device model as torchtitan builds it.
"""

from __future__ import annotations

import functools
import importlib.util
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from distributed import distributed

TOL = 1e-5
DIM, N_HEADS, N_KV, FFN, VOCAB, LAYERS, SEQ = 24, 12, 6, 24, 36, 2, 6  # sizes that split over 2 and 3


class FusedQKV(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = DIM // N_HEADS
        self.heads_per_kv = N_HEADS // N_KV
        self.r_dim = self.heads_per_kv + 2
        self.wqkv = nn.Linear(DIM, N_KV * self.r_dim * self.head_dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.wqkv(x).view(b, s, -1, self.r_dim, self.head_dim)
        q, k, v = torch.split(qkv, [self.heads_per_kv, 1, 1], dim=-2)
        return tuple(t.reshape(b, s, -1, self.head_dim) for t in (q, k, v))


class QKV(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = DIM // N_HEADS
        self.wq = nn.Linear(DIM, N_HEADS * self.head_dim, bias=False)
        self.wk = nn.Linear(DIM, N_KV * self.head_dim, bias=False)
        self.wv = nn.Linear(DIM, N_KV * self.head_dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        return tuple(w(x).view(b, s, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))


class Attention(nn.Module):
    def __init__(self, fused: bool):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = N_HEADS, N_KV, DIM // N_HEADS
        self.enable_gqa = self.n_heads > self.n_kv_heads
        self.qkv_linear = FusedQKV() if fused else QKV()
        self.wo = nn.Linear(N_HEADS * self.head_dim, DIM, bias=False)
        self.register_buffer("freqs_cis", self.rope_cache(), persistent=False)

    def rope_cache(self):
        freqs = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        angles = torch.outer(torch.arange(SEQ).float(), freqs)
        return torch.polar(torch.ones_like(angles), angles)

    def rope(self, x):
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * self.freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, -1)).flatten(3)

    def forward(self, x, attention_masks=None, positions=None):
        q, k, v = self.qkv_linear(x)
        q, k = self.rope(q), self.rope(k)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, enable_gqa=self.enable_gqa)
        return self.wo(out.transpose(1, 2).flatten(2))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(DIM, FFN, bias=False), nn.Linear(FFN, DIM, bias=False), \
            nn.Linear(DIM, FFN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, fused: bool):
        super().__init__()
        self.attention, self.feed_forward = Attention(fused), FeedForward()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)

    def forward(self, x, attention_masks=None, positions=None):
        h = x + self.attention(self.attention_norm(x), attention_masks, positions)
        return h + self.feed_forward(self.ffn_norm(h))


class Decoder(nn.Module):
    """torchtitan 0.3's Llama 3 Decoder, small."""

    def __init__(self, fused: bool = True):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block(fused) for i in range(LAYERS)})
        self.norm, self.lm_head = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def init_weights(self, buffer_device=None):
        for name, p in self.named_parameters():
            nn.init.ones_(p) if "norm" in name else nn.init.normal_(p, std=0.3)
        for attn in (b.attention for b in self.layers.values()):
            attn.freqs_cis = attn.rope_cache().to(buffer_device or attn.freqs_cis.device)

    _skip_lm_head = False  # torchtitan's chunked loss calls lm_head itself

    def forward(self, tokens, positions=None, attention_masks=None):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, attention_masks, positions)
        h = self.norm(h)
        return h if self._skip_lm_head else self.lm_head(h)


def _reference(fused: bool) -> Decoder:
    model = Decoder(fused)
    torch.manual_seed(0)  # the values come from init_weights alone, as for a meta-built model
    model.init_weights()
    return model


def _batch(rows: int):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (rows, SEQ), generator=g), torch.randint(0, VOCAB, (rows, SEQ), generator=g)


def _loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _compare(model, ref, loss, ref_loss) -> dict:
    grads = dict(ref.named_parameters())
    out = {"loss": _rel(loss, ref_loss), "names": sorted(n for n, _ in model.named_parameters())}
    out["ref names"] = sorted(grads)
    out["grads"] = {n: _rel(_full(p.grad), grads[n].grad) for n, p in model.named_parameters()}
    return out


def _tp():
    from torch.distributed.device_mesh import init_device_mesh

    from overlapkit.integrations.torchtitan import parallelize_transformer

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    tokens, labels = _batch(2)
    out = {}
    for fused in (True, False):
        ref = _reference(fused)
        ref_loss = _loss(ref, tokens, labels)
        ref_loss.backward()
        model = parallelize_transformer(_reference(fused), mesh)
        loss = _loss(model, tokens, labels)
        loss.backward()
        out[fused] = _compare(model, ref, loss, ref_loss)
        out[fused]["wo"] = type(model.layers["0"].attention.wo).__name__
    return out


def _parallel_dims(real: bool):
    """torchtitan's own ParallelDims (fsdp 2 x tp 2) when `real`, else one with its attributes."""
    if real:
        from torchtitan.distributed import parallel_dims
        from torchtitan.distributed.parallel_dims import ParallelDims

        parallel_dims.device_type = "cpu"  # torchtitan assumes "cuda" where it finds no accelerator
        dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=1, world_size=4,
                            spmd_backend="partial_dtensor")
        dims.build_mesh()
        return dims, dims.get_mesh("fsdp")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    return SimpleNamespace(tp_enabled=True, dp_shard_enabled=True, pp_enabled=False, cp_enabled=False,
                           ep_enabled=False, dp_replicate_enabled=False,
                           get_mesh=lambda d: mesh[d] if isinstance(d, str) else mesh[tuple(d)]), mesh["fsdp"]


@distributed(world_size=4, timeout_s=120.0)
def _tp2_fsdp2(real_dims: bool):
    from overlapkit.integrations.torchtitan import parallelize_llama3

    dims, fsdp = _parallel_dims(real_dims)
    training = SimpleNamespace(mixed_precision_param="float32", mixed_precision_reduce="float32")
    tokens, labels = _batch(4)
    ref = _reference(True)  # rank 0 below draws the same values, from seed 0
    ref_loss = _loss(ref, tokens, labels)
    ref_loss.backward()
    with torch.device("meta"):  # as torchtitan builds it
        model = Decoder(True)
    torch.manual_seed(100 * dist.get_rank())  # other seeds on other ranks: rank 0's weights must win
    model = parallelize_llama3(model, parallel_dims=dims, training=training,
                               parallelism=SimpleNamespace(enable_sequence_parallel=False))
    model.to_empty(device="cpu")  # what torchtitan's trainer does after parallelize_fn
    model.init_weights(buffer_device=None)
    dp = fsdp.get_local_rank()
    rows = slice(2 * dp, 2 * dp + 2)  # both TP ranks of a dp rank see the same rows
    # torchtitan's loss: this rank's token sum over the global token count, gradients summed over dp
    tokens_all = torch.tensor(float(labels.numel()))
    if real_dims:  # torchtitan's own chunked cross-entropy, calling lm_head on sequence chunks
        from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

        loss_fn = ChunkedLossWrapper.Config(num_chunks=2, loss_fn=CrossEntropyLoss.Config()).build()
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
        loss, _ = loss_fn(model(tokens[rows]), labels[rows], global_valid_tokens=tokens_all)
    else:
        loss = F.cross_entropy(model(tokens[rows]).flatten(0, 1), labels[rows].flatten(), reduction="sum") / tokens_all
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)  # the sum over dp, twice: both TP ranks of a dp rank hold it
    out = _compare(model, ref, total / 2, ref_loss)
    out["placements"] = str(model.layers["0"].feed_forward.w1.weight.placements)
    return out


@distributed(world_size=2, timeout_s=90.0)
def _tp2():
    return _tp()


@distributed(world_size=3, timeout_s=90.0)
def _tp3():
    return _tp()


@functools.cache
def tp_results(world: int):
    return {2: _tp2, 3: _tp3}[world]()


def _check(r):
    assert r["names"] == r["ref names"], r
    assert r["loss"] <= TOL, r
    bad = {n: e for n, e in r["grads"].items() if not e <= TOL}
    assert not bad, bad


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("fused", [True, False], ids=["fused_wqkv", "wq_wk_wv"])
def test_tp_matches_one_process(fused, world):
    for r in tp_results(world):
        _check(r[fused])
        assert r[fused]["wo"] == "RowParallelLinear", r[fused]["wo"]


def _has_torchtitan() -> bool:
    return importlib.util.find_spec("torchtitan") is not None


@pytest.mark.parametrize("real_dims", [False, True], ids=["stand_in_dims", "torchtitan_ParallelDims"])
def test_tp2_fsdp2_through_torchtitans_signature_matches_one_process(real_dims):
    if real_dims and not _has_torchtitan():
        pytest.skip("torchtitan is not installed (not in the test extras: its Llama 3 needs triton)")
    for r in _tp2_fsdp2(real_dims):
        _check(r)
        assert "Shard(dim=0)" in r["placements"] and r["placements"].count("Shard") == 2, r["placements"]


def test_plan_refuses_what_does_not_split():
    from overlapkit.integrations.torchtitan import llama3_plan

    with pytest.raises(ValueError, match="n_kv_heads=6 is not divisible by the tensor-parallel size 4"):
        llama3_plan(_reference(True), 4)


def test_refuses_pipeline_parallelism_and_tied_embeddings_under_fsdp():
    from overlapkit.integrations.torchtitan import parallelize_llama3

    dims = SimpleNamespace(pp_enabled=True, tp_enabled=False)
    with pytest.raises(ValueError, match="pp_enabled"):
        parallelize_llama3(_reference(True), parallel_dims=dims)
    tied = _reference(True)
    tied.enable_weight_tying = True
    with pytest.raises(ValueError, match="enable_weight_tying with fsdp"):
        parallelize_llama3(tied, parallel_dims=SimpleNamespace(dp_shard_enabled=True, tp_enabled=False))


def test_with_overlapkit_swaps_the_parallelize_fn_of_a_torchtitan_model_spec():
    if not _has_torchtitan():
        pytest.skip("torchtitan is not installed (not in the test extras: its Llama 3 needs triton)")
    from torchtitan.protocols.model_spec import ModelSpec

    from overlapkit.integrations.torchtitan import SPEC_NAME, parallelize_llama3, with_overlapkit

    spec = ModelSpec(name="llama3", flavor="debugmodel", model=object(), parallelize_fn=print,
                     pipelining_fn=print, post_optimizer_build_fn=None, state_dict_adapter=None)
    config = with_overlapkit(SimpleNamespace(model_spec=spec))
    assert config.model_spec.name == SPEC_NAME and config.model_spec.flavor == "debugmodel"
    assert config.model_spec.parallelize_fn is parallelize_llama3 and config.model_spec.pipelining_fn is None
    assert config.model_spec.model is spec.model


def test_register_swaps_in_overlapkits_parallelize():
    if not _has_torchtitan():
        pytest.skip("torchtitan is not installed (not in the test extras: its Llama 3 needs triton)")
    from overlapkit.integrations import torchtitan as adapter

    try:
        config = adapter.llama3_debugmodel()  # what `--config llama3_debugmodel` calls
    except ImportError as e:
        pytest.skip(f"torchtitan's Llama 3 registry cannot be imported here: {e}")
    spec = config.model_spec
    assert spec.name == adapter.SPEC_NAME and spec.flavor == "debugmodel"
    assert spec.parallelize_fn is adapter.parallelize_llama3 and spec.pipelining_fn is None
    assert type(spec.model).__name__ == "Llama3Model.Config" or type(spec.model).__name__ == "Config"
