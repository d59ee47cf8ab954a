"""Decode steps replayed from CUDA graphs: the step's launches (GEMMs, the fused all-reduces) issued by one call.

What it overlaps: the host's launch work with the device's compute. A decode step at small batch is
launch-bound: hundreds of small kernels, each costing the host more than the device. Captured once
per input signature, a step is then one `graph.replay()` on inputs copied into the captured tensors.
The warm-up before capture (first-shape checks, communicators, symmetric buffers and cuBLAS workspaces
must exist before it) is the signature's first real calls, run eagerly on a side stream and returned:
never an extra call. A decode step mutates state in place (transformers' static cache advances its
`cumulative_length` on the device and writes the step's keys there), so a warm-up call made on the side
would move the cache one position per call and every later step would write past where it should
(seen on an H100: `index_copy_(): index out of bounds`, and wrong tokens before that). Capturing runs no
kernel, so each call moves the state exactly once: eagerly, or by its replay. The collectives inside are NCCL's or
the one-shot symmetric-memory all-reduce, both capturable.

`StepGraphs` captures any function of tensors whose shapes repeat; it needs CUDA tensors and is
never used on CPU. A function that cannot be captured (a host synchronization inside, an op that
refuses capture) raises while capturing: that signature is then run eagerly from then on, and the
reason kept in `refused` (never a silent wrong replay: a signature replays only what it captured).
"""

from __future__ import annotations

import dataclasses

import torch


def _key(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device)
    if isinstance(value, (bool, int, float, str, type(None))):
        return ("value", value)
    return ("object", id(value))  # e.g. the static KV cache: the same object every step, or a new graph


class StepGraphs:
    """`fn(**kwargs)` captured once per signature (tensor shapes and dtypes, the other values as they are,
    objects by identity) in a CUDA graph and replayed after copying the tensors in; the output's tensors
    are cloned out of the graph's memory before they are returned, so the next replay cannot overwrite
    what a caller holds. At most `keep` signatures are held (a new KV cache object is a new signature)."""

    def __init__(self, fn, *, warmup: int = 2, keep: int = 8) -> None:
        """`warmup`: real calls of a signature run eagerly (on a side stream) before it is captured."""
        self.fn, self.warmup, self.keep = fn, warmup, keep
        self.graphs: dict[tuple, tuple] = {}
        """signature -> (graph, static inputs, static output)."""
        self.refused: dict[tuple, str] = {}
        """signature -> why it could not be captured (run eagerly); the newest 4 x `keep` of them."""
        self.replays = 0
        """How many calls were served by a replay."""
        self.pool = None
        self._side = None
        self._seen: dict[tuple, int] = {}
        """signature -> real calls run eagerly so far (the warm-up before its capture)."""

    def __call__(self, **kwargs):
        key = tuple(sorted((k, _key(v)) for k, v in kwargs.items()))
        if key in self.refused:
            return self.fn(**kwargs)
        entry = self.graphs.get(key)
        if entry is None and self._seen.get(key, 0) < self.warmup:
            self._seen[key] = self._seen.get(key, 0) + 1
            if len(self._seen) > 4 * self.keep:  # a new KV cache a generate() is a new key: keep the newest
                self._seen.pop(next(iter(self._seen)))
            return self._eager_on_side_stream(kwargs)
        if entry is None:
            self._seen.pop(key, None)  # warmed up: captured (or refused) from here on
            if len(self.graphs) >= self.keep:
                # the oldest signature goes (its graph's memory with it); the static inputs an entry holds keep
                # the objects it was keyed on alive, so an id in a key is never another object's
                self.graphs.pop(next(iter(self.graphs)))
            try:
                entry = self.graphs[key] = self._capture(kwargs)
            except RuntimeError as e:
                self.refused[key] = str(e).splitlines()[0]
                if len(self.refused) > 4 * self.keep:  # as `_seen`: a new KV cache a generate() is a new key
                    self.refused.pop(next(iter(self.refused)))
                torch.cuda.synchronize()
                return self.fn(**kwargs)
        graph, static, out = entry
        for name, value in kwargs.items():
            if isinstance(value, torch.Tensor):
                static[name].copy_(value)
        graph.replay()
        self.replays += 1
        return _cloned(out)

    def _side_stream(self):
        # one stream for the warm-up calls and the capture (cuBLAS keys its workspace by stream); each use
        # waits for the current stream first, so a block freed there is never reused here too early
        if self._side is None:
            self._side = torch.cuda.Stream()
        self._side.wait_stream(torch.cuda.current_stream())
        return self._side

    def _eager_on_side_stream(self, kwargs: dict):
        side = self._side_stream()
        with torch.cuda.stream(side):
            out = self.fn(**kwargs)
        torch.cuda.current_stream().wait_stream(side)
        return out

    def _capture(self, kwargs: dict):
        """The graph of one call of `fn` on clones of `kwargs` (capture runs no kernel: the call's effect comes
        from the replay that follows)."""
        static = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self._side_stream()):
            out = self.fn(**static)
        return graph, static, out


def _cloned(out):
    """The output with each of its tensors cloned (a ModelOutput dataclass, a tuple, a tensor)."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, tuple):
        return type(out)(_cloned(x) for x in out)
    if dataclasses.is_dataclass(out) and hasattr(out, "items"):  # transformers' ModelOutput: its set fields
        return type(out)(**{k: _cloned(v) for k, v in out.items()})
    if dataclasses.is_dataclass(out):
        return dataclasses.replace(out, **{f.name: _cloned(getattr(out, f.name)) for f in dataclasses.fields(out)
                                           if isinstance(getattr(out, f.name), torch.Tensor)})
    return out
