"""What every rank feeds a parallel model, compared across its group before the model's first collective.

Nothing here overlaps anything. Ranks of one tensor-parallel group must be fed the same batch
(the same token ids), ranks of a context-parallel group the same-sized slices, and so on: a
rank fed `[2, 12]` while its peer has `[2, 8]` makes the first all-reduce of different sizes
(gloo aborts the process), and TP ranks fed different ids of one shape return a loss that is
neither rank's, silently. `check_inputs` compares, once per forward, a small fixed-size int64
vector per rank — a CRC of every input tensor's path, shape and dtype, a digest of the integer
inputs (their sum and a position-weighted sum) and any counters the engine adds — in ONE
all-gather on a sibling group of the same ranks. The sibling keeps the check from ever pairing
with an engine collective when ranks are out of step (one skipped backward): a check then waits
for a check, and a rank that never comes is named by `agreement.raise_explained`.

When the vectors differ (every rank sees the same gathered rows, so all take this path together)
the ranks compare a readable description through the store (`agreement.agree`), and every rank
raises the same RankMismatchError naming the ranks and the values. The steady state pays the
digest's few small kernels, one tiny all-gather and reading its result on the host.
"""

from __future__ import annotations

import datetime
import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten_with_path, keystr

from . import state
from .agreement import RankMismatchError, agree, raise_explained, report_problem
from .departure import hold_store
from .timeouts import group_timeout_s

_CHECK_GROUPS: dict[str, Any] = state.cache_dict("entry.check_groups")
"""Each group's sibling (same ranks, same backend and timeout) that carries only entry checks."""
_WEIGHTS: dict[tuple, torch.Tensor] = state.cache_dict("entry.digest_weights")
"""Per (device, length): the position weights of the ids digest, made once."""
_META: dict[tuple, torch.Tensor] = state.cache_dict("entry.meta_vectors")
"""Per (device, meta values): the host-known part of the vector, on the device once."""

WEIGHT_PERIOD = 65521
"""Position weights run 1..WEIGHT_PERIOD (a prime): a swap of two ids changes the weighted sum."""


def check_group(group):
    """The sibling of `group` that carries only entry checks: a backend of the same kind on the same
    ranks, built on first use by its ranks alone, rendezvousing under a key named after `group`.

    Not `new_group`: the world would have to call it in step, and its local-synchronization names
    are hashes that two members with different group histories resolve differently.
    """
    name = group.group_name
    sibling = _CHECK_GROUPS.get(name)
    if sibling is None:
        store = dist.distributed_c10d._get_default_store()
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        generation = (store.add(f"overlapkit/check/{name}/made", 1) - 1) // size  # again after state.reset()
        prefixed = dist.PrefixStore(f"overlapkit/check/{name}/{generation}/", store)
        timeout = datetime.timedelta(seconds=group_timeout_s(group))
        if dist.get_backend(group) == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            sibling = dist.ProcessGroupNCCL(prefixed, rank, size, options)
        else:
            sibling = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
        _CHECK_GROUPS[name] = sibling
        hold_store()  # at exit, say this rank left: a peer that published waits for it
    return sibling


def _inputs(args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    """Every tensor the call was given, named as the caller wrote it ("argument 0", "labels")."""
    top = [(f"argument {i}", a) for i, a in enumerate(args)] + list(kwargs.items())
    if not any(isinstance(v, (tuple, list, dict)) for _, v in top):
        return [(k, v) for k, v in top if isinstance(v, torch.Tensor)]  # the common case, without pytree
    out = []
    for name, value in top:
        for path, leaf in tree_flatten_with_path(value)[0]:
            if isinstance(leaf, torch.Tensor):
                out.append((name + keystr(path), leaf))
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _digest(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    flat = _local(t).reshape(-1).to(torch.int64)
    key = (flat.device, flat.numel())
    w = _WEIGHTS.get(key)
    if w is None:
        w = _WEIGHTS[key] = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64) % WEIGHT_PERIOD + 1
    return flat.sum(), (flat * w).sum()


def _meta_vector(values: tuple, device) -> torch.Tensor:
    key = (device, values)
    v = _META.get(key)
    if v is None:
        if len(_META) > 256:  # a model fed ever new shapes: keep the cache bounded
            _META.clear()
        v = _META[key] = torch.tensor(values, dtype=torch.int64, device=device)
    return v


def _describe(inputs, digest: bool, counters: dict) -> dict:
    fields = {}
    for path, t in inputs:
        fields[path] = f"{list(t.shape)} {t.dtype}"
        if digest and not t.dtype.is_floating_point and not t.dtype.is_complex:
            s, ws = _digest(t)
            fields[f"{path} values"] = f"sum {int(s)}, weighted sum {int(ws)}"
    fields.update(counters)
    return fields


def check_inputs(group, what: str, args: tuple = (), kwargs: dict | None = None, *, same_values: bool = True,
                 counters: dict[str, int] | None = None, extra: torch.Tensor | None = None, hint: str = "",
                 defer: bool = False):
    """Raise RankMismatchError on every rank of `group` unless every rank passed inputs alike.

    Alike: the same tensors (by their place in args/kwargs) of the same shapes and dtypes and,
    with `same_values` (tensor parallelism: one batch for the whole group), the same integer
    values (token ids, labels, masks; a digest, not the bytes). `counters` (name -> int) must be
    equal too: an engine's count of backward passes or optimizer steps. One all-gather of a few
    int64 per rank on `check_group(group)`. `extra`: int64 values that must be equal too (a digest
    of the parameters; the same length on every rank at every call). `hint` ends the message.
    A group of one rank, or no group, passes.
    `defer`: post the all-gather and return a function that waits for it and compares (None when
    there is nothing to check), so that compute runs while a late peer catches up; the caller calls
    it before its own first collective of the step.
    """
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1 \
            or torch.compiler.is_compiling():  # compiled, the collectives compare their own sizes
        return
    kwargs = kwargs or {}
    counters = counters or {}
    inputs = _inputs(args, kwargs)
    meta = repr([(p, tuple(t.shape), str(t.dtype)) for p, t in inputs]).encode()
    device = check_device(group)
    # Fixed length on every rank (a gather of unequal sizes aborts gloo): the CRC covers the
    # inputs' paths, shapes and dtypes, the two sums every integer input's values.
    head = _meta_vector((zlib.crc32(meta), len(inputs)), device)
    if counters:  # they change every step: not worth a cache entry each
        head = torch.cat([head, torch.tensor(list(counters.values()), dtype=torch.int64).to(device, non_blocking=True)])
    sums = [torch.stack(_digest(t.to(device))) for _, t in inputs
            if same_values and not t.dtype.is_floating_point and not t.dtype.is_complex]
    mine = torch.cat([head, torch.stack(sums).sum(0) if sums else _meta_vector((0, 0), device)]
                     + ([extra.to(device)] if extra is not None else []))
    world = dist.get_world_size(group)
    out = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
    try:
        work = check_group(group)._allgather_base(out, mine)
    except Exception as e:  # noqa: BLE001 - a peer never came: say why if it said
        raise_explained(group, what, e, _waiting_text(counters))

    def finish() -> None:
        try:
            work.wait()
            rows = out.view(world, -1).tolist()
        except Exception as e:  # noqa: BLE001 - a peer never came: say why if it said
            raise_explained(group, what, e, _waiting_text(counters))
        if not all(r == rows[0] for r in rows):
            _mismatch(group, what, inputs, same_values, counters, extra, hint, rows)

    if defer:
        return finish
    finish()
    return None


def _mismatch(group, what: str, inputs, same_values: bool, counters: dict, extra, hint: str, rows) -> None:
    fields = _describe(inputs, same_values, counters)
    if extra is not None:
        fields["parameter digest"] = extra.tolist()
    try:
        agree(group, what, **fields)
    except RankMismatchError as e:
        text = f"{e} ({hint})" if hint else str(e)
        report_problem(group, what, text)
        raise RankMismatchError(text) from None
    ranks = dist.get_process_group_ranks(group)
    raise RankMismatchError(f"{what}: ranks {ranks} were fed inputs whose digests differ "
                            + ", ".join(f"rank {r}: {row}" for r, row in zip(ranks, rows)))


def _waiting_text(counters: dict) -> str:
    done = ", ".join(f"{v} {k}" for k, v in counters.items())
    return ("the other ranks at the entry of its next forward" + (f" (it has done {done})" if done else "")
            + ": it left the previous step while the others still wait inside it — it skipped a part of that "
            "step (backward() or optimizer.step()) or a forward")


def check_device(group) -> torch.device:
    """Where `group`'s entry check runs: the current GPU under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def guard_entry(model: nn.Module, group, what: str, *, same_values: bool = True) -> None:
    """Run `check_inputs` on every forward of `model`, before its first collective (a forward pre-hook).

    One guard per (model, `what`): guarding again replaces it; a TP and a CP guard stand side by side.
    """
    guards = model.__dict__.setdefault("_overlapkit_entry_guards", {})
    if what in guards:
        guards.pop(what).remove()

    def hook(_module, args, kwargs):
        check_inputs(group, what, args, kwargs, same_values=same_values)

    guards[what] = model.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
