"""What the GEMMs of the parallel layers are handed: dense 2-D matrices, and no activation-sized copies.

For sequence dims 0 ([s, b, h], Megatron's) and 1 ([b, s, h], every HF model's), every overlap
mode, forward and backward, at one rank and at two:
- every matrix product the layers run is an `mm`/`addmm` on 2-D operands that are dense in rows
  or in columns (a transposed dense matrix is a BLAS flag, not a copy); never a `bmm` — what
  a transposed [b, s, h] view into F.linear becomes, a batched kernel several times slower;
- no copy of an activation-sized tensor beyond what the mode needs. Inside a sequence-parallel
  region the activations are kept sequence-major once (the layout `ScatterSequence` hands out
  and every layer returns), so a column -> GELU -> row chain copies nothing at any rank. An
  input in the other layout (what HF's attention hands `o_proj`) costs exactly one copy, and only
  where rows must travel by sequence (two ranks with SP); at one rank nothing moves and the GEMM
  takes the rows in whatever order they lie.
The numbers these layers compute are checked elsewhere (test_precision_and_layout.py); here,
only what reaches the kernels. Counted with a TorchDispatchMode over the aten ops.
"""

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from distributed import distributed
from overlapkit.runtime import comm
from overlapkit.tensor_parallel import ColumnParallelLinear, RowParallelLinear, mappings
from overlapkit.tensor_parallel.styles import GatheredInputColumnLinear

aten = torch.ops.aten
MODES = ("none", "bulk", "pipelined", "auto")
GEMMS = {aten.mm.default, aten.addmm.default, aten.mm.out}
BATCHED = {aten.bmm.default, aten.baddbmm.default, aten.bmm.out}
COPIES = {aten.clone.default, aten.copy_.default, aten._to_copy.default, aten.contiguous.default}


def _dense_2d(t: torch.Tensor) -> bool:
    if t.dim() != 2:
        return False
    rows, cols = t.shape
    return t.stride() in ((cols, 1), (1, rows)) or 1 in (rows, cols)


class _Kernels(TorchDispatchMode):
    """Every GEMM's operands and every copy of at least `big` elements, as the kernels see them.

    Ops the transport runs inside a collective (gloo's reduce-scatter copies its slice out of
    an all-reduce when it is waited for) are the collective's, not the layer's: not counted.
    """

    in_transport = 0

    def __init__(self, big: int) -> None:
        super().__init__()
        self.big, self.bad_gemms, self.batched, self.copies = big, [], [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _Kernels.in_transport:
            return out
        if func in BATCHED:
            self.batched.append(tuple(a.shape for a in args[:2]))
        elif func in GEMMS:
            mats = [a for a in args if isinstance(a, torch.Tensor) and a.dim() == 2]
            if any(not _dense_2d(m) for m in mats):
                self.bad_gemms.append([(tuple(m.shape), m.stride()) for m in mats])
        elif func in COPIES and isinstance(out, torch.Tensor) and out.numel() >= self.big:
            dst = args[0] if func is aten.copy_.default else out
            # Writing into part of a larger buffer is a transfer's local share (an all-gather
            # writes this rank's own rows into the gathered matrix), not a layout copy.
            if dst._base is None or dst._base.numel() == dst.numel():
                self.copies.append((str(func), tuple(out.shape)))
        return out


def _in_transport(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        _Kernels.in_transport += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _Kernels.in_transport -= 1
    return wrapped


def _mark_transport() -> None:
    """Count nothing the collectives themselves run (their issue and their wait)."""
    if not getattr(comm, "_marked_for_layout_test", False):
        comm.launch = _in_transport(comm.launch)
        comm.Handle.wait = _in_transport(comm.Handle.wait)
        comm._marked_for_layout_test = True


def _seq_major(shape, sd: int) -> torch.Tensor:
    """A [b, s, h] (sd=1) tensor laid out sequence-major, as ScatterSequence hands it out."""
    if sd == 0:
        return torch.randn(*shape)
    b, s, h = shape
    return torch.randn(s, b, h).transpose(0, 1)


def _layers(group, mode: str, sd: int, sp: bool):
    """A column [h -> f] and a row [f -> h] layer, the column's input shape, and the smallest activation's size."""
    torch.manual_seed(0)
    ws = dist.get_world_size(group)
    b, s, h, f = 3, 8 * ws, 8, 16  # every activation (>= b * s/ws * h) outsizes every weight (<= f * h)
    kw = dict(sequence_parallel=sp, sequence_dim=sd, overlap=mode)
    col = ColumnParallelLinear.from_full(nn.Linear(h, f), group, **kw)
    row = RowParallelLinear.from_full(nn.Linear(f, h), group, **kw)
    local_s = s // ws if sp else s
    shape = (b, local_s, h) if sd == 1 else (local_s, b, h)
    return col, row, shape, b * (s // ws) * h


def _count(fn, big: int, x: torch.Tensor):
    # autograd.grad, not backward(): a leaf input's AccumulateGrad would copy its gradient into
    # the leaf's own layout, a copy of this test's making (a layer's input is never a leaf).
    with _Kernels(big) as k:
        y = fn(x)
        torch.autograd.grad(y, x, torch.randn_like(y))
    return y, (k.bad_gemms, k.batched, k.copies)


def _chain(mode: str, sd: int, sp: bool):
    """col -> GELU -> row on a layout-ready input: GEMM operands and big copies, forward and backward."""
    col, row, shape, big = _layers(dist.group.WORLD, mode, sd, sp)
    x = _seq_major(shape, sd).requires_grad_()
    y, seen = _count(lambda t: row(nn.functional.gelu(col(t))), big, x)
    assert y.shape == x.shape
    return seen


def _batch_major(shape, sd: int) -> torch.Tensor:
    """A [b, s, h] (sd=1) or [s, b, h] (sd=0) tensor laid out batch-major."""
    if sd == 1:
        return torch.randn(*shape)
    s, b, h = shape
    return torch.randn(b, s, h).transpose(0, 1)


def _other_layout(mode: str, sd: int):
    """A row layer given a batch-major input (what HF's attention hands o_proj), and a column layer on an
    already gathered input (q/k/v under GatherSequence) in either layout: GEMM operands and copy counts."""
    group = dist.group.WORLD
    ws = dist.get_world_size(group)
    _, row, col_shape, big = _layers(group, mode, sd, True)
    full = list(col_shape)
    full[sd] *= ws  # the whole sequence
    row_in = list(full)
    row_in[-1] = 16 // ws
    _, seen = _count(row, big, _batch_major(row_in, sd).requires_grad_())
    counts = {"row": seen}
    torch.manual_seed(1)
    q = GatheredInputColumnLinear.from_full(nn.Linear(full[-1], 16), group, overlap="none", sequence_parallel=False)
    for name, make in (("gathered_seq_major", _seq_major), ("gathered_batch_major", _batch_major)):
        _, counts[name] = _count(q, big, make(full, sd).requires_grad_())
    return {k: (bad, batched, len(copies)) for k, (bad, batched, copies) in counts.items()}


def _everything():
    """Every case at this world size, in one spawn of the ranks (spawning costs more than the cases)."""
    _mark_transport()
    chains = {(mode, sd, sp): _chain(mode, sd, sp) for mode in MODES for sd in (0, 1)
              for sp in ((True, False) if mode in ("none", "bulk") else (True,))}
    others = {(mode, sd): _other_layout(mode, sd) for mode in MODES for sd in (0, 1)}
    return chains, others


@distributed(world_size=1)
def _everything_1():
    return _everything()


@distributed(world_size=2)
def _everything_2():
    return _everything()


@functools.cache
def _results(ws: int):
    return (_everything_1 if ws == 1 else _everything_2)()


@pytest.mark.parametrize("ws", [1, 2])
def test_chain_hands_dense_matrices_and_copies_nothing(ws):
    for rank, (chains, _) in enumerate(_results(ws)):
        for (mode, sd, sp), (bad, batched, copies) in chains.items():
            where = f"mode={mode} sp={sp} sd={sd} ws={ws} rank {rank}"
            assert not batched, f"{where}: batched GEMMs {batched}"
            assert not bad, f"{where}: GEMM operands not dense 2-D: {bad}"
            assert not copies, f"{where}: activation-sized copies {copies}"


@pytest.mark.parametrize("ws", [1, 2])
def test_batch_major_input_costs_one_copy_only_where_rows_travel(ws):
    for rank, (_, others) in enumerate(_results(ws)):
        for (mode, sd), counts in others.items():
            for what, (bad, batched, copies) in counts.items():
                where = f"{what} mode={mode} sd={sd} ws={ws} rank {rank}"
                assert not batched and not bad, f"{where}: batched {batched}, not dense {bad}"
                # A batch-major input to a row layer must become sequence-major before a
                # reduce-scatter over the sequence: one copy, and only when rows travel.
                expected = 1 if (what == "row" and ws > 1) else 0
                assert copies == expected, f"{where}: {copies} activation-sized copies, expected {expected}"


@distributed(world_size=2)
def _mappings_layout():
    group = dist.group.WORLD
    torch.manual_seed(0)
    x = torch.randn(3, 8, 4)  # [b, s, h], batch-major, as an embedding returns it
    local = mappings.scatter_to_sp(x, group, dim=1)
    full = mappings.gather_from_sp(local, group, dim=1)
    return (local.transpose(0, 1).is_contiguous(), full.transpose(0, 1).is_contiguous(), torch.equal(full, x))


def test_sequence_parallel_region_is_sequence_major():
    """scatter_to_sp / gather_from_sp along dim 1 hand out sequence-major views (no transpose copy back)."""
    for local_sm, full_sm, same in _mappings_layout():
        assert local_sm and full_sm and same
