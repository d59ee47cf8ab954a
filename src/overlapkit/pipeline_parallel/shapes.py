"""What crosses between pipeline stages, learned before any transfer: every chunk's output shape and
dtype (a sweep of each chunk on zeros, chunk after chunk, through the job's store), and what decides
them on each rank (autocast, the parameters' shapes and dtypes), compared every step so that a
change after the first step re-learns them instead of receiving bytes into a buffer of the old
shape. Nothing here overlaps anything.
"""

from __future__ import annotations

import datetime
import hashlib
import json

import torch
import torch.distributed as dist

from ..runtime import state
from ..runtime.agreement import RankMismatchError
from ..runtime.groups import group_timeout_s

_SWEEPS: dict[str, int] = state.cache_dict("pipeline.shape_sweeps")
"""Shape sweeps run so far on each pipeline group, by group name: the k-th sweep of a group has the
same store keys on every rank, and no sweep reads an earlier one's (stale) shapes."""


class StageSignature:
    """This rank's part of what decides the inter-stage shapes, read every step: autocast (on the
    chunks' device type), the floating-point parameter dtypes, and a digest of every parameter's
    shape and dtype in module order (recomputed only when those change)."""

    def __init__(self) -> None:
        self._layout: list | None = None
        self._digest: dict = {}

    def of(self, chunks, device: torch.device) -> dict:
        dt = device.type
        autocast = [True, str(torch.get_autocast_dtype(dt))] \
            if dt in ("cpu", "cuda") and torch.is_autocast_enabled(dt) else [False, None]
        layout = _layout(chunks)
        if layout != self._layout:
            dtypes = sorted({str(d) for d, _ in layout if d.is_floating_point})
            text = json.dumps([(str(d), list(s)) for d, s in layout])
            self._layout, self._digest = layout, {"dtypes": dtypes,
                                                  "layout": hashlib.sha1(text.encode()).hexdigest()[:16]}
        return {"autocast": autocast, **self._digest}


def _layout(chunks) -> list:
    """(dtype, shape) of every parameter of the chunks, module by module: a plain walk, because
    Module.parameters() costs ~2.5 µs a parameter, which a check made every step should not pay."""
    out, stack = [], list(reversed(chunks))
    while stack:
        module = stack.pop()
        out += [(p.dtype, p.shape) for p in module._parameters.values() if p is not None]
        stack += [m for m in reversed(module._modules.values()) if m is not None]
    return out


def infer_shapes(engine, in_sig) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The output shape and dtype of every chunk but the last, by running each once, chunk after chunk, on zeros
    (the last one too: that it takes what the one before gives it).

    The shapes travel through the job's store (not the pipeline group), so this sweep sends nothing
    the timetable does not expect; each rank waits at most the group's timeout. A chunk that cannot
    take what the previous one produces publishes its error instead, and every rank raises it.
    """
    store = dist.distributed_c10d._get_default_store()
    name = engine.group.group_name
    prefix = f"overlapkit/pp/{name}/shapes/{_SWEEPS.get(name, 0)}/"
    _SWEEPS[name] = _SWEEPS.get(name, 0) + 1
    timeout = datetime.timedelta(seconds=group_timeout_s(engine.group))
    shape, dtype = in_sig
    n = engine.n_chunks
    for c in range(n):
        if engine.table.rank_of(c) != engine.rank:
            continue
        got = None
        if c > 0:
            store.wait([prefix + str(c - 1)], timeout)
            got = json.loads(store.get(prefix + str(c - 1)))
        if got is not None and "error" in got:
            result = got  # passed on, so that every later chunk's rank has it too
        else:
            if got is not None:
                shape, dtype = got["shape"], got["dtype"]
            x = torch.zeros(shape, dtype=getattr(torch, dtype.removeprefix("torch.")), device=engine.device)
            try:
                with torch.no_grad():
                    y = engine._local(c)(x)
                result = {"shape": list(y.shape), "dtype": str(y.dtype)}
            except Exception as e:  # raised below on every rank, with this rank's words
                result = {"error": f"pipeline rank {engine.rank}'s chunk {c} cannot take {list(shape)} {dtype} "
                                   f"(what {'the input' if c == 0 else f'chunk {c - 1}'} gives it): "
                                   f"{type(e).__name__}: {e}"}
        store.set(prefix + str(c), json.dumps(result))
    keys = [prefix + str(c) for c in range(n)]
    store.wait(keys, timeout)
    out = []
    for k in keys:
        got = json.loads(store.get(k))
        if "error" in got:
            raise RankMismatchError(f"pipeline step: {got['error']}")
        out.append((tuple(got["shape"]), getattr(torch, got["dtype"].removeprefix("torch."))))
    return out[:-1]
