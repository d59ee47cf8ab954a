"""A pipeline-parallel training step whose stage-to-stage transfers run under the compute of
other micro-batches (1F1B / interleaved 1F1B, overlap_p2p), and whose data-parallel gradient
reduction starts inside the pipeline's cool-down, as soon as a chunk's last backward is done.

Each rank runs its actions (schedules.rank_actions) in the timetable's tick order and issues
each tick's transfers through `TickComm`. A chunk wrapped in `DataParallel` accumulates its
micro-batch gradients under `no_sync`, except the micro-batch whose backward is the chunk's
last: that backward launches the chunk's buckets as their gradients complete, while the other
chunks and stages are still in their cool-down. The gradient for the previous stage is sent
from a hook on the chunk's input, before DataParallel's end-of-backward wait, so the reduction
never delays the neighbour. With a `ShardedOptimizer`, nothing waits for its parameter gathers
before the step: each module's pre-forward hook waits for its own bucket at its first forward,
so the gathers land while the stage waits for its first input (the warm-up).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..agreement import RankMismatchError, agree
from ..data_parallel import DataParallel
from ..groups import group_timeout_s
from ..timeline import recorder as _rec
from ..timeline.recorder import compute_span
from .p2p import TickComm, producer_key, record_bubbles, recording, restamp_receives
from .schedules import SCHEDULES, Action, check_schedule, rank_actions, timetable


_SWEEPS: dict[str, int] = {}
"""Shape sweeps run so far on each pipeline group, by group name: the k-th sweep of a group has the
same store keys on every rank, and no sweep reads an earlier one's (stale) shapes."""


@dataclass(frozen=True)
class PipelineConfig:
    """How a pipeline step runs."""

    schedule: str = "1f1b"
    """"gpipe" (all forwards, then all backwards: the simple reference), "1f1b" (one forward, one
    backward in the steady state: at most pp micro-batches' activations alive) or
    "interleaved-1f1b" (v chunks per rank: the bubble shrinks from (p-1)/m to (p-1)/(v·m))."""
    microbatches: int = 4
    """Micro-batches per step (m). 1f1b needs m >= pp; interleaved-1f1b a multiple of pp."""
    virtual_stages: int = 1
    """Chunks per rank (v). More chunks: a smaller bubble, v times the transfers."""
    overlap_p2p: bool = True
    """Post the next receive before computing and never wait for a send, so transfers run under
    compute. False waits for every tick's transfers at once: the synchronous reference."""
    broadcast_loss: bool = False
    """Return the loss on every pipeline rank (one small all-reduce), not only on the last."""

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"PipelineConfig.schedule={self.schedule!r} is not one of {SCHEDULES}")
        for name in ("microbatches", "virtual_stages"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"PipelineConfig.{name} must be an integer >= 1, got {v!r}")
        for name in ("overlap_p2p", "broadcast_loss"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"PipelineConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if self.schedule == "1f1b" and self.virtual_stages != 1:
            raise ValueError(f"PipelineConfig.virtual_stages={self.virtual_stages} needs schedule='interleaved-1f1b' "
                             "(or 'gpipe'); '1f1b' runs one chunk per rank")


@dataclass
class StepTiming:
    """What one recorded step looked like on this rank (host clock, ms on the recorder's origin)."""

    step: int
    bubbles: list[tuple[float, float]] = field(default_factory=list)
    """Intervals this rank waited for a neighbour that had not sent yet: the pipeline bubble."""
    actions: list[tuple[str, int, int, float, float]] = field(default_factory=list)
    """(op, mb, chunk, start, end) of every forward and backward."""

    @property
    def steady(self) -> tuple[float, float] | None:
        """From the first backward's start to the last forward's end: the 1F1B steady state."""
        b = [a[3] for a in self.actions if a[0] == "B"]
        f = [a[4] for a in self.actions if a[0] == "F"]
        return (min(b), max(f)) if b and f and max(f) > min(b) else None


class PipelineEngine:
    """Runs a pipeline step over `chunks`, this rank's chunks (global chunk k·pp + rank at local k).

    `group` is the pipeline group (ParallelGroups.pp). A chunk may be a DataParallel; its
    reduction then runs inside the cool-down. `loss_fn(output, target)` is the per-micro-batch
    loss on the last chunk; the step's loss is their mean, and gradients are those of that mean.
    Each chunk takes one tensor and returns one tensor.
    """

    def __init__(self, chunks: Sequence[nn.Module], group, config: PipelineConfig,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                 device: torch.device | str | None = None) -> None:
        self.chunks, self.group, self.config, self.loss_fn = list(chunks), group, config, loss_fn
        self.pp, self.rank = comm.group_size(group), comm.group_rank(group)
        cfg = config
        agree(group, "PipelineEngine", schedule=cfg.schedule, microbatches=cfg.microbatches,
              virtual_stages=cfg.virtual_stages, overlap_p2p=cfg.overlap_p2p, broadcast_loss=cfg.broadcast_loss,
              chunks_here=len(self.chunks))
        if len(self.chunks) != cfg.virtual_stages:
            raise ValueError(f"PipelineEngine: rank {self.rank} holds {len(self.chunks)} chunks but "
                             f"virtual_stages={cfg.virtual_stages}")
        check_schedule(cfg.schedule, self.pp, cfg.virtual_stages, cfg.microbatches)
        # Data-parallel replicas must run the same step, or their bucket reductions would pair up wrong.
        for g in {id(c.group): c.group for c in self.chunks if isinstance(c, DataParallel)}.values():
            agree(g, "PipelineEngine (data-parallel replicas)", schedule=cfg.schedule,
                  microbatches=cfg.microbatches, virtual_stages=cfg.virtual_stages, pp=self.pp)
        self.table = timetable(cfg.schedule, self.pp, cfg.virtual_stages, cfg.microbatches)
        self.n_chunks = self.pp * cfg.virtual_stages
        self.device = torch.device(device) if device is not None else _device_of(self.chunks)
        self._by_tick = {t: a for t, a in self.table.ticks[self.rank]}
        self._sends, self._recvs = self.table.sends(self.rank), self.table.recvs(self.rank)
        self._last_backward = {}
        for _, a in self.table.ticks[self.rank]:
            if a.op == "B":
                self._last_backward[a.chunk] = a.mb
        self._shapes: dict[tuple, list] = {}
        self.timings: list[StepTiming] = []
        """One entry per step run while a CPU timeline recorder was active."""

    # -- the step ------------------------------------------------------------------------------
    def step(self, inputs=None, targets=None) -> torch.Tensor | None:
        """One forward and backward of every micro-batch. Returns the mean loss (last rank, or all with broadcast_loss).

        `inputs` (on the rank holding chunk 0) and `targets` (on the rank holding the last chunk)
        are a list of `microbatches` tensors, or one tensor split into that many along dim 0.
        """
        m = self.config.microbatches
        first, last = self.rank == 0, self.rank == (self.n_chunks - 1) % self.pp
        inputs = _split(inputs, m) if first else None
        targets = _split(targets, m) if last else None
        in_sig = self._check_microbatches(inputs, targets)
        if in_sig not in self._shapes:
            self._shapes[in_sig] = self._infer_shapes(in_sig)
        tc = TickComm(self.table, self.rank, self.group, self.config.overlap_p2p, self._shapes[in_sig], self.device,
                      self._sends, self._recvs)
        timing = StepTiming(step=_rec.active().step) if recording() else None
        results: dict[tuple[str, int, int], torch.Tensor] = {}
        stash: dict[tuple[int, int], tuple] = {}
        loss_sum = torch.zeros((), device=self.device)
        tc.start()
        for tick in range(self.table.n_ticks):
            a = self._by_tick.get(tick)
            if a is not None:
                t0 = time.perf_counter()
                if a.op == "F":
                    loss = self._forward(a, tc, inputs, targets, results, stash)
                    if loss is not None:
                        loss_sum += loss.detach()
                else:
                    self._backward(a, tc, tick, results, stash)
                if timing is not None:
                    timing.actions.append((a.op, a.mb, a.chunk, *_ms((t0, time.perf_counter()))))
            tc.post(tick, results)
            for t in self._sends.get(tick, []):
                results.pop(producer_key(t), None)
        tc.finish()
        if timing is not None:
            self._split_bubble(tc, timing)
        if self.config.broadcast_loss:
            out = loss_sum.clone() if last else torch.zeros((), device=self.device)
            comm.all_reduce(out, self.group, kind="pp_send", name="loss", async_op=False)
            return out
        return loss_sum if last else None

    def _forward(self, a: Action, tc: TickComm, inputs, targets, results, stash):
        chunk = self.chunks[a.chunk // self.pp]
        if a.chunk == 0:
            x = inputs[a.mb]
        else:
            x = tc.take(a) if tc.has(a) else results.pop(("F", a.chunk - 1, a.mb)).detach()
            if x.is_floating_point():
                x.requires_grad_(True)
        sync = not isinstance(chunk, DataParallel) or a.mb == self._last_backward[a.chunk]
        with compute_span(f"pp.F{a.mb}.c{a.chunk}"), (contextlib.nullcontext() if sync else chunk.no_sync()):
            out = chunk(x)
            loss = None
            if a.chunk == self.n_chunks - 1:
                loss = self.loss_fn(out, targets[a.mb]) / self.config.microbatches
        stash[(a.chunk, a.mb)] = (x, loss if loss is not None else out)
        if loss is None:
            results[("F", a.chunk, a.mb)] = out
        return loss

    def _backward(self, a: Action, tc: TickComm, tick: int, results, stash) -> None:
        x, out = stash.pop((a.chunk, a.mb))
        if a.chunk == self.n_chunks - 1:
            grad = None
        else:
            grad = tc.take(a) if tc.has(a) else results.pop(("B", a.chunk + 1, a.mb))
        if a.chunk > 0:
            def send_early(g, a=a):
                # The previous chunk's gradient leaves now, before DataParallel's end-of-backward wait.
                results[("B", a.chunk, a.mb)] = g
                if self.config.overlap_p2p:
                    tc.post(tick, results)
            x.register_hook(send_early)
        with compute_span(f"pp.B{a.mb}.c{a.chunk}"):
            torch.autograd.backward(out, grad)

    # -- checks and shapes -----------------------------------------------------------------------
    def _check_microbatches(self, inputs, targets) -> tuple:
        """Every pipeline rank learns the first rank's input shapes and the last rank's target shapes,
        and all raise the same error, before any transfer, if they do not fit together."""
        m = self.config.microbatches
        describe = lambda ts, f: ts if ts is None or isinstance(ts, str) else [f(t) for t in ts]  # noqa: E731
        mine = {"inputs": describe(inputs, lambda t: (list(t.shape), str(t.dtype))),
                "targets": describe(targets, lambda t: list(t.shape))}
        if isinstance(mine["inputs"], str) or isinstance(mine["targets"], str):
            mine = {"problem": mine["inputs"] if isinstance(mine["inputs"], str) else mine["targets"]}
        seen = [None] * self.pp
        dist.all_gather_object(seen, mine, group=self.group)
        bad = [f"pipeline rank {r}: {s['problem']}" for r, s in enumerate(seen) if "problem" in s]
        if bad:
            raise RankMismatchError("pipeline step: " + "; ".join(bad))
        ins, tgts = seen[0]["inputs"], seen[(self.n_chunks - 1) % self.pp]["targets"]
        problems = [f"the {'first' if what == 'inputs' else 'last'} pipeline rank was given no {what}"
                    for what, got in (("inputs", ins), ("targets", tgts)) if got is None]
        if problems:
            raise RankMismatchError("pipeline step: " + "; ".join(problems))
        for what, got in (("inputs", ins), ("targets", tgts)):
            if len(got) != m:
                problems.append(f"{len(got)} micro-batches of {what} for microbatches={m}")
        if len({json.dumps(s) for s in ins}) > 1:
            problems.append(f"input micro-batches differ in shape/dtype: {ins}")
        if len({json.dumps(s) for s in tgts}) > 1:
            problems.append(f"target micro-batches differ in shape: {tgts}")
        if ins and tgts and (not ins[0][0] or not tgts[0] or ins[0][0][0] != tgts[0][0]):
            problems.append(f"the first stage's input micro-batch {ins[0][0]} and the last stage's target "
                            f"micro-batch {tgts[0]} differ in batch size (dim 0)")
        if problems:
            raise RankMismatchError(f"pipeline step (pp ranks {dist.get_process_group_ranks(self.group)}): "
                                    + "; ".join(problems))
        return (tuple(ins[0][0]), ins[0][1])

    def _infer_shapes(self, in_sig) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The output shape and dtype of every chunk, by running each once, chunk after chunk, on zeros.

        The shapes travel through the job's store (not the pipeline group), so this sweep sends
        nothing the timetable does not expect; each rank waits at most the group's timeout.
        """
        store = dist.distributed_c10d._get_default_store()
        name = self.group.group_name
        prefix = f"overlapkit/pp/{name}/shapes/{_SWEEPS.get(name, 0)}/"
        _SWEEPS[name] = _SWEEPS.get(name, 0) + 1
        timeout = datetime.timedelta(seconds=group_timeout_s(self.group))
        shape, dtype = in_sig[0], in_sig[1]
        for c in range(self.n_chunks - 1):
            if c % self.pp == self.rank:
                if c > 0:
                    store.wait([prefix + str(c - 1)], timeout)
                    shape, dtype = json.loads(store.get(prefix + str(c - 1)))
                x = torch.zeros(shape, dtype=getattr(torch, dtype.removeprefix("torch.")), device=self.device)
                with torch.no_grad():
                    y = self.chunks[c // self.pp](x)
                store.set(prefix + str(c), json.dumps([list(y.shape), str(y.dtype)]))
        keys = [prefix + str(c) for c in range(self.n_chunks - 1)]
        if keys:
            store.wait(keys, timeout)
        out = []
        for k in keys:
            s, d = json.loads(store.get(k))
            out.append((tuple(s), getattr(torch, d.removeprefix("torch."))))
        return out

    def _split_bubble(self, tc: TickComm, timing: StepTiming) -> None:
        """Split every receive wait into bubble (before the neighbour sent) and transfer (after), and
        count the drain (this rank done, the pipeline not yet) as bubble too. Host clocks: one host."""
        mine = (tc.send_times, time.perf_counter())
        seen = [None] * self.pp
        dist.all_gather_object(seen, mine, group=self.group)
        bubbles = restamp_receives(tc.waits, {r: s[0] for r, s in enumerate(seen)})
        t0 = _rec.active()._t0
        last_end = t0 + max(a[4] for a in timing.actions) / 1e3 if timing.actions else mine[1]
        bubbles.append((last_end, max(s[1] for s in seen)))
        bubbles = [b for b in bubbles if b[1] > b[0]]
        record_bubbles(bubbles, timing.step)
        timing.bubbles = [_ms(b) for b in bubbles]
        self.timings.append(timing)


def _ms(pair: tuple[float, float]) -> tuple[float, float]:
    t0 = _rec.active()._t0
    return ((pair[0] - t0) * 1e3, (pair[1] - t0) * 1e3)


def _split(batch, m: int):
    """The micro-batches of `batch`; None when none was given; a message (raised on every rank) when it cannot split."""
    if batch is None:
        return None
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0 or batch.shape[0] % m:
            return (f"a batch of shape {list(batch.shape)} does not split into microbatches={m} "
                    "equal micro-batches along dim 0")
        return list(batch.chunk(m))
    return list(batch)


def _device_of(chunks) -> torch.device:
    for c in chunks:
        for p in c.parameters():
            return p.device
    return torch.device("cpu")
