"""Ranks that disagree on a TP layer's arguments or input shape fail on EVERY rank, naming the field.

Before: chunks=2 on one rank and 4 on the other killed one rank with SIGABRT inside the transport
while the other returned a result read from a buffer no transfer filled. Now each layer compares
its arguments across the TP group when built and each new input signature when first seen, before
any collective. Then a hypothesis fuzz over per-rank perturbations of layer arguments and input
shapes: every example equals the reference on every rank, or raises on every rank.
"""

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import nn

from distributed import distributed
from overlapkit.tensor_parallel import ColumnParallelLinear, RowParallelLinear


def _outcome(fn):
    try:
        fn()
        return None
    except Exception as e:  # noqa: BLE001 — what each rank raised is the result
        return f"{type(e).__name__}: {e}"


def _cases(r: int):
    g = dist.group.WORLD

    def piped(**kw):
        return dict(sequence_parallel=True, overlap="pipelined", **kw)

    def chunks_mutated():
        layer = ColumnParallelLinear(4, 4, g, **piped(chunks=2))
        layer.chunks = 2 if r == 0 else 4  # changed after construction: caught at the next forward
        layer(torch.randn(4, 4))

    def grad_on_one_rank():
        layer = RowParallelLinear(4, 4, g, sequence_parallel=True)
        with torch.set_grad_enabled(r == 0):
            layer(torch.randn(4, 2, requires_grad=True))

    return {
        "chunks": lambda: ColumnParallelLinear(4, 4, g, **piped(chunks=2 if r == 0 else 4))(torch.randn(4, 4)),
        "sequence length": lambda: ColumnParallelLinear(4, 4, g, **piped())(torch.randn(4 if r == 0 else 6, 4)),
        "hidden": lambda: RowParallelLinear(8 if r == 0 else 12, 4, g)(torch.randn(3, 4 if r == 0 else 6)),
        "batch": lambda: RowParallelLinear(4, 4, g, sequence_parallel=True)(torch.randn(4, 1 + r, 2)),
        "sp on one rank": lambda: ColumnParallelLinear(4, 4, g, sequence_parallel=r == 0)(torch.randn(2, 4)),
        "in_features=-8 on one rank": lambda: ColumnParallelLinear(-8 if r == 0 else 8, 4, g),
        "in_features=-8 everywhere": lambda: ColumnParallelLinear(-8, 4, g),
        "chunks mutated": chunks_mutated,
        "grad on one rank": grad_on_one_rank,
        "sequence_dim": lambda: RowParallelLinear(4, 4, g, sequence_parallel=True, sequence_dim=r)(
            torch.randn(2, 2, 2)),
    }


FIELD = {"chunks": "chunks differs", "sequence length": "shape differs", "hidden": "in_features differs",
         "batch": "shape differs", "sp on one rank": "sequence_parallel differs",
         "in_features=-8 on one rank": "in_features differs",
         "in_features=-8 everywhere": "in_features=-8 must be an integer >= 1",
         "chunks mutated": "chunks differs", "grad on one rank": "grad_enabled differs",
         "sequence_dim": "sequence_dim differs"}


@distributed(world_size=2, timeout_s=60)
def _mismatches():
    out = {name: _outcome(case) for name, case in _cases(dist.get_rank()).items()}
    dist.barrier()  # every rank got here: nobody hangs in a collective
    return out


def test_every_rank_raises_naming_the_field():
    per_rank = _mismatches()
    for name, needle in FIELD.items():
        for rank, out in enumerate(per_rank):
            msg = out[name]
            assert msg is not None, f"{name}: rank {rank} returned instead of raising"
            assert needle in msg, (name, rank, msg)
            assert "math domain" not in msg
        if "everywhere" not in name:
            assert "RankMismatchError" in per_rank[0][name] and per_rank[0][name] == per_rank[1][name]


# -- fuzz ------------------------------------------------------------------------------

_BASE = st.fixed_dictionaries({
    "kind": st.sampled_from(["column", "row"]),
    "overlap": st.sampled_from(["none", "bulk", "pipelined", "auto"]),
    "chunks": st.sampled_from([None, 2, 4]),
    "fin": st.sampled_from([4, 8]), "fout": st.sampled_from([4, 8]),
    "seq": st.sampled_from([2, 4, 8]), "batch": st.sampled_from([1, 2]),
    "sequence_dim": st.sampled_from([0, 1]),
})
_PERTURB = st.one_of(st.none(), st.tuples(st.sampled_from(["chunks", "fin", "fout", "seq", "batch", "overlap",
                                                           "sequence_dim"]),
                                          st.sampled_from([None, 1, 2, 4, 6, -8, "bulk"])))


def _examples(n: int = 8) -> list:
    """n (base config, perturbation of rank 1) pairs drawn by hypothesis, here in pytest's process."""
    drawn = []

    @settings(max_examples=n, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(_BASE, _PERTURB)
    def collect(base, perturb):
        drawn.append((base, perturb))

    collect()
    return drawn[:n]


def _run_example(base: dict, perturb, rank: int):
    cfg = dict(base)
    if perturb is not None and rank == 1:
        cfg[perturb[0]] = perturb[1]
    g = dist.group.WORLD
    Layer = ColumnParallelLinear if cfg["kind"] == "column" else RowParallelLinear
    kw = dict(sequence_parallel=True, sequence_dim=cfg["sequence_dim"], overlap=cfg["overlap"])
    if cfg["overlap"] == "pipelined":
        kw["chunks"] = cfg["chunks"]
    torch.manual_seed(3)
    full = nn.Linear(4 if not isinstance(cfg["fin"], int) or cfg["fin"] < 1 else cfg["fin"],
                     4 if not isinstance(cfg["fout"], int) or cfg["fout"] < 1 else cfg["fout"])
    layer = Layer(cfg["fin"], cfg["fout"], g, **kw)
    with torch.no_grad():
        layer.load_state_dict(full.state_dict())
    lead = [cfg["seq"], cfg["batch"]] if cfg["sequence_dim"] == 0 else [cfg["batch"], cfg["seq"]]
    sd = cfg["sequence_dim"] if isinstance(cfg["sequence_dim"], int) else 0
    X = torch.randn(*lead, full.in_features)
    Y = full(X)
    if cfg["kind"] == "column":
        x, y_ref = X.chunk(2, sd)[rank], Y.chunk(2, -1)[rank]
    else:
        x, y_ref = X.chunk(2, -1)[rank], Y.chunk(2, sd)[rank]
    y = layer(x.contiguous())
    return ((y - y_ref).norm() / y_ref.norm()).item()


@distributed(world_size=2, timeout_s=90)
def _fuzz(examples):
    rank, out = dist.get_rank(), []
    for base, perturb in examples:
        try:
            out.append(("ok", _run_example(base, perturb, rank)))
        except Exception as e:  # noqa: BLE001
            out.append(("raised", f"{type(e).__name__}: {e}"))
    dist.barrier()
    return out


def test_fuzz_per_rank_perturbations_equal_reference_or_raise_everywhere():
    examples = _examples(8)
    assert len(examples) == 8
    per_rank = _fuzz(examples)
    for i, (base, perturb) in enumerate(examples):
        (k0, v0), (k1, v1) = per_rank[0][i], per_rank[1][i]
        assert k0 == k1, (base, perturb, per_rank[0][i], per_rank[1][i])
        if k0 == "ok":
            assert max(v0, v1) <= 1e-5, (base, perturb, v0, v1)
        else:
            assert "math domain" not in v0 + v1
