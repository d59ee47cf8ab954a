"""A pipeline-parallel training step whose stage-to-stage transfers run under the compute of other
micro-batches (1F1B, interleaved 1F1B, zero-bubble, DualPipeV; overlap="bulk"), whose weight-gradient
GEMMs fill what was the bubble (ZB-H1, ZB-V, DualPipeV), and whose data-parallel gradient reduction
starts inside the pipeline's cool-down, as soon as a chunk's last gradients are done.

Each rank runs its slots (schedules.rank_slots) in the timetable's tick order and issues each
tick's transfers through `TickComm`; the slots themselves are in actions.py. The gradient for the
previous stage is sent from a hook on the chunk's input, before any end-of-backward wait, so a
data-parallel reduction never delays the neighbour. With a `ShardedOptimizer`, nothing waits for
its parameter gathers before the step: each module's pre-forward hook waits for its own bucket at
its first forward, so the gathers land while the stage waits for its first input (the warm-up).

Every step, the ranks compare what decides the inter-stage shapes (the first rank's inputs,
autocast, each rank's parameter shapes and dtypes) in the step's one small all-gather (of a digest; the
descriptions themselves only when a digest is new); anything new
(autocast turned on, stages cast to bf16, a width changed, on every rank alike) re-learns the shapes
before any transfer, and what must match across ranks and does not fails on every rank, naming it.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import InitVar, dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..runtime import comm
from ..runtime.agreement import RankMismatchError, agree
from ..runtime.deprecation import deprecated
from ..data_parallel import DataParallel
from ..runtime import recorder as _rec
from ..vocabulary import OVERLAP_MEANING, positive_int
from .actions import SlotActions, StepState
from .p2p import TickComm, producer_key, record_bubbles, recording, restamp_receives
from .schedules import SCHEDULES, SPLIT_SCHEDULES, check_costs, check_schedule, chunks_of, placement
from .shapes import StageSignature, infer_shapes
from .timetable import timetable
from .pair import PairRunner
from .wgrad import LinearRouter


@dataclass(frozen=True)
class PipelineConfig:
    """How a pipeline step runs."""

    schedule: str = "1f1b"
    """"gpipe" (all forwards, then all backwards: the simple reference), "1f1b" (one forward, one
    backward in the steady state: at most pp micro-batches' activations alive), "interleaved-1f1b"
    (v chunks per rank: the bubble shrinks from (p-1)/m to (p-1)/(v·m)), "zb1p" (ZB-H1: 1F1B whose
    weight gradients fill the cool-down, at 1F1B's peak memory), "zbv" (ZB-V: two chunks a rank in
    a V, weight gradients wherever a rank would wait) or "dualpipev" (DeepSeek's DualPipeV: a V whose
    steady state overlaps the forward of one micro-batch with the backward of another)."""
    microbatches: int = 4
    """Micro-batches per step (m). 1f1b and zb1p need m >= pp; interleaved-1f1b a multiple of pp;
    dualpipev m >= 2·pp."""
    virtual_stages: int = 1
    """Chunks per rank (v). More chunks: a smaller bubble, v times the transfers. zbv and dualpipev: 2."""
    overlap: str = "bulk"
    """"bulk": post the next receive before computing and never wait for a send, so transfers run under
    compute. "none" waits for every tick's transfers at once: the synchronous reference."""
    broadcast_loss: bool = False
    """Return the loss on every pipeline rank (one small all-reduce), not only on the last."""
    overlap_pairs: bool = True
    """DualPipeV: run each pair's forward and backward interleaved, each one's communication under the
    other's compute (pair.py). False runs the forward, then the backward: the reference."""
    costs: tuple[float, float, float] = (1.0, 1.0, 1.0)
    """Relative durations of a chunk's forward, input-gradient backward and weight-gradient backward:
    zbv builds its order for them (equal by default, where its steady state has no bubble)."""
    split_backward: bool = False
    """gpipe, 1f1b, interleaved-1f1b: run each backward as its input gradient, sent on at once, then
    its weight gradients (the linears' GEMMs, held from the backward: wgrad.py). The previous rank gets
    its gradient a weight-gradient's time sooner, which shortens every backward hop of the pipeline;
    the order, the micro-batches in flight and the peak memory stay the schedule's. The forward runs
    each nn.Linear through an autograd Function that keeps its weight-gradient GEMM for W (a Python
    call per linear; nothing per other op)."""
    overlap_p2p: InitVar[bool | None] = None
    """The earlier spelling of `overlap`: True is "bulk", False "none" (a DeprecationWarning once).
    Read back, `config.overlap_p2p` is whether overlap is on."""

    def __post_init__(self, overlap_p2p: bool | None) -> None:
        if isinstance(self.overlap, bool) and overlap_p2p is None:  # the old field's place, given positionally
            overlap_p2p = self.overlap
        if overlap_p2p is not None:
            deprecated("PipelineConfig(overlap_p2p=...)", 'PipelineConfig(overlap="bulk" | "none")')
            if not isinstance(overlap_p2p, bool):
                raise ValueError(f"PipelineConfig.overlap_p2p must be True or False, got {overlap_p2p!r}")
            object.__setattr__(self, "overlap", "bulk" if overlap_p2p else "none")
        if self.overlap not in OVERLAP_MEANING["pp"]:
            raise ValueError(f"PipelineConfig.overlap={self.overlap!r} is not one of {tuple(OVERLAP_MEANING['pp'])}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"PipelineConfig.schedule={self.schedule!r} is not one of {SCHEDULES}")
        for name in ("microbatches", "virtual_stages"):
            positive_int(getattr(self, name), f"PipelineConfig.{name}")
        for name in ("broadcast_loss", "overlap_pairs", "split_backward"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"PipelineConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if self.schedule in ("1f1b", "zb1p") and self.virtual_stages != 1:
            raise ValueError(f"PipelineConfig.virtual_stages={self.virtual_stages} needs schedule='interleaved-1f1b' "
                             f"(or 'gpipe', or zbv / dualpipev with 2); {self.schedule!r} runs one chunk per rank")
        if self.schedule in ("zbv", "dualpipev") and self.virtual_stages != 2:
            raise ValueError(f"PipelineConfig.virtual_stages={self.virtual_stages}: schedule {self.schedule!r} runs "
                             "exactly two chunks per rank (virtual_stages=2)")
        if self.split_backward and self.schedule in SPLIT_SCHEDULES:
            raise ValueError(f"PipelineConfig.split_backward=True: schedule {self.schedule!r} already runs its "
                             "weight gradients apart (split_backward is for gpipe, 1f1b and interleaved-1f1b)")
        try:
            check_costs(self.costs)
        except ValueError as e:
            raise ValueError(f"PipelineConfig.{e}") from None


# The old field read back: a property over the one stored setting (the InitVar left its default here).
PipelineConfig.overlap_p2p = property(lambda self: self.overlap == "bulk",
                                      doc='Whether overlap is "bulk" (the earlier spelling of the setting).')


@dataclass
class StepTiming:
    """What one recorded step looked like on this rank (host clock, ms on the recorder's origin)."""

    step: int
    bubbles: list[tuple[float, float]] = field(default_factory=list)
    """Intervals this rank waited for a neighbour that had not sent yet: the pipeline bubble."""
    actions: list[tuple[str, int, int, float, float]] = field(default_factory=list)
    """(op, mb, chunk, start, end) of every F, B and W (the two halves of a pair share its interval)."""
    kept_w_peak_bytes: int = 0
    """The most bytes the deferred weight-gradient GEMMs kept at once (their inputs, held gradients)."""

    @property
    def steady(self) -> tuple[float, float] | None:
        """From the first backward's start to the last forward's end: the 1F1B steady state."""
        b = [a[3] for a in self.actions if a[0] == "B"]
        f = [a[4] for a in self.actions if a[0] == "F"]
        return (min(b), max(f)) if b and f and max(f) > min(b) else None


class PipelineEngine(SlotActions):
    """Runs a pipeline step over `chunks`, this rank's chunks in local order (schedules.chunks_of).

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
              virtual_stages=cfg.virtual_stages, overlap=cfg.overlap, broadcast_loss=cfg.broadcast_loss,
              overlap_pairs=cfg.overlap_pairs, costs=list(cfg.costs), split_backward=cfg.split_backward,
              chunks_here=len(self.chunks))
        if len(self.chunks) != cfg.virtual_stages:
            raise ValueError(f"PipelineEngine: rank {self.rank} holds {len(self.chunks)} chunks but "
                             f"virtual_stages={cfg.virtual_stages}")
        check_schedule(cfg.schedule, self.pp, cfg.virtual_stages, cfg.microbatches)
        self.style = placement(cfg.schedule)
        mine = chunks_of(self.rank, self.pp, cfg.virtual_stages, self.style)
        self._check_placement(mine)
        # Data-parallel replicas must run the same step, or their bucket reductions would pair up wrong.
        for g in {id(c.group): c.group for c in self.chunks if isinstance(c, DataParallel)}.values():
            agree(g, "PipelineEngine (data-parallel replicas)", schedule=cfg.schedule,
                  microbatches=cfg.microbatches, virtual_stages=cfg.virtual_stages, pp=self.pp,
                  split_backward=cfg.split_backward)
        self.table = timetable(cfg.schedule, self.pp, cfg.virtual_stages, cfg.microbatches, cfg.costs,
                               split_backward=cfg.split_backward)
        self.n_chunks = self.pp * cfg.virtual_stages
        self.device = torch.device(device) if device is not None else _device_of(self.chunks)
        self._local_of = {c: k for k, c in enumerate(mine)}
        self._by_tick = {t: slot for t, slot in self.table.ticks[self.rank]}
        self._sends, self._recvs = self.table.sends(self.rank), self.table.recvs(self.rank)
        self._last_backward, self._split_b = {}, set()
        for _, slot in self.table.ticks[self.rank]:
            for a in slot:
                if a.op == "B":
                    self._last_backward[a.chunk] = a.mb
                    if not any(w.op == "W" and w.chunk == a.chunk and w.mb == a.mb for w in slot) \
                            and (cfg.schedule in SPLIT_SCHEDULES or cfg.split_backward):
                        self._split_b.add((a.chunk, a.mb))
        if self._split_b:
            self._refuse_unsplittable()
        self._linear_router = {c: LinearRouter([self._local(c)]) for c in mine}
        self._pairs = PairRunner()
        self._shapes: dict[tuple, list] = {}
        self._signature = StageSignature()
        self._checked: dict[tuple, tuple] = {}  # every rank's description digest -> the step's key, once checked
        self.timings: list[StepTiming] = []
        """One entry per step run while a CPU timeline recorder was active."""
        self.last_kept_w_peak_bytes = 0
        """The most bytes the last step's deferred weight-gradient GEMMs kept at once on this rank."""

    def _check_placement(self, mine: list[int]) -> None:
        """A chunk cut for another placement (pipeline_chunk set by gpt_chunks / sequential_chunks) fails here."""
        got = [getattr(c.module if isinstance(c, DataParallel) else c, "pipeline_chunk", None) for c in self.chunks]
        if any(g is not None for g in got) and got != mine:
            raise ValueError(f"PipelineEngine: schedule {self.config.schedule!r} places chunks {mine} on pipeline rank "
                             f"{self.rank} ({self.style!r} placement), but this rank was given chunks {got}: cut the "
                             f"model with style={self.style!r}")

    def _refuse_unsplittable(self) -> None:
        from torch.distributed.fsdp import FSDPModule
        for c in self.chunks:
            if any(isinstance(m, FSDPModule) for m in c.modules()):
                raise ValueError(f"PipelineEngine: schedule {self.config.schedule!r} defers weight gradients past the "
                                 "backward, but a chunk is sharded with fully_shard (FSDP2 reduce-scatters each "
                                 "module's gradients at its backward and frees the unsharded weights): use 1f1b or "
                                 "interleaved-1f1b with fully_shard, or DataParallel / ShardedOptimizer")

    # -- the step ------------------------------------------------------------------------------
    def step(self, inputs=None, targets=None) -> torch.Tensor | None:
        """One forward and backward of every micro-batch. Returns the mean loss (last rank, or all with broadcast_loss).

        `inputs` (on the rank holding chunk 0) and `targets` (on the rank holding the last chunk)
        are a list of `microbatches` tensors, or one tensor split into that many along dim 0.
        """
        m = self.config.microbatches
        first, last = self.rank == 0, self.rank == self.table.rank_of(self.n_chunks - 1)
        inputs = _split(inputs, m) if first else None
        targets = _split(targets, m) if last else None
        key = self._check_step(inputs, targets)
        if key not in self._shapes:
            self._shapes[key] = infer_shapes(self, key[0])
        shapes = self._shapes[key]
        tc = TickComm(self.table, self.rank, self.group, self.config.overlap == "bulk", shapes, self.device,
                      self._sends, self._recvs)
        timing = StepTiming(step=_rec.active().step) if recording() else None
        st = StepState(tc=tc, inputs=inputs, targets=targets, shapes=shapes,
                       loss_sum=torch.zeros((), device=self.device))
        tc.start()
        for tick in range(self.table.n_ticks):
            slot = self._by_tick.get(tick)
            if slot is not None:
                self._run_slot(slot, tick, st)
            tc.post(tick, st.results)
            for t in self._sends.get(tick, []):
                st.results.pop(producer_key(t), None)
        tc.finish()
        if timing is not None:
            timing.actions = [(op, mb, c, *_ms((t0, t1))) for op, mb, c, t0, t1 in st.actions]
            timing.kept_w_peak_bytes = st.peak_kept_bytes
            self._split_bubble(tc, timing)
        self.last_kept_w_peak_bytes = st.peak_kept_bytes
        if self.config.broadcast_loss:
            out = st.loss_sum.clone() if last else torch.zeros((), device=self.device)
            comm.all_reduce(out, self.group, kind="pp_send", name="loss", async_op=False)
            return out
        return st.loss_sum if last else None

    # -- checks ----------------------------------------------------------------------------------
    def _check_step(self, inputs, targets) -> tuple:
        """Every pipeline rank learns the first rank's input shapes, the last rank's target shapes and every
        rank's stage signature; all raise the same error, before any transfer, if they do not fit together.

        Returns the key of this step's inter-stage shapes: (input shape and dtype, autocast, every rank's
        parameter layout). A new key (autocast turned on, a cast, a width changed) re-learns the shapes."""
        m = self.config.microbatches
        describe = lambda ts, f: ts if ts is None or isinstance(ts, str) else [f(t) for t in ts]  # noqa: E731
        mine = {"inputs": describe(inputs, lambda t: (list(t.shape), str(t.dtype))),
                "targets": describe(targets, lambda t: list(t.shape))}
        if isinstance(mine["inputs"], str) or isinstance(mine["targets"], str):
            mine = {"problem": mine["inputs"] if isinstance(mine["inputs"], str) else mine["targets"]}
        mine["stage"] = self._signature.of(self.chunks, self.device)
        # Every step, one all-gather of an int64 digest of each rank's description; the descriptions
        # themselves (all_gather_object: two collectives and pickling, what set this step apart from
        # torch's schedules) travel only when the digests are new: the first step, a change, a mismatch.
        digests = [torch.empty(1, dtype=torch.int64, device=self.device) for _ in range(self.pp)]
        dist.all_gather(digests, torch.tensor([_digest(mine)], device=self.device), group=self.group)
        digests = tuple(int(d) for d in torch.cat(digests).tolist())
        known = self._checked.get(digests)
        if known is not None:
            return known
        seen = [None] * self.pp
        dist.all_gather_object(seen, mine, group=self.group)
        bad = [f"pipeline rank {r}: {s['problem']}" for r, s in enumerate(seen) if "problem" in s]
        if bad:
            raise RankMismatchError("pipeline step: " + "; ".join(bad))
        problems = _stage_mismatches([s["stage"] for s in seen])
        ins, tgts = seen[0]["inputs"], seen[self.table.rank_of(self.n_chunks - 1)]["targets"]
        problems += [f"the {'first' if what == 'inputs' else 'last'} pipeline rank was given no {what}"
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
        stages = tuple(json.dumps(s["stage"], sort_keys=True) for s in seen)
        key = ((tuple(ins[0][0]), ins[0][1]), stages)
        if len(self._checked) >= 16:  # descriptions that change every step: keep the memory bounded
            self._checked.clear()
        self._checked[digests] = key
        return key

    def _split_bubble(self, tc: TickComm, timing: StepTiming) -> None:
        """Split every receive wait into bubble (before the neighbour sent) and transfer (after), and
        count the drain (this rank done, the pipeline not yet) as bubble too. Host clocks: one host."""
        mine = (tc.send_times, time.perf_counter())
        seen = [None] * self.pp
        dist.all_gather_object(seen, mine, group=self.group)
        bubbles = restamp_receives(tc.waits, {r: s[0] for r, s in enumerate(seen)})
        t0 = _rec.active().host_origin
        last_end = t0 + max(a[4] for a in timing.actions) / 1e3 if timing.actions else mine[1]
        bubbles.append((last_end, max(s[1] for s in seen)))
        bubbles = [b for b in bubbles if b[1] > b[0]]
        record_bubbles(bubbles, timing.step)
        timing.bubbles = [_ms(b) for b in bubbles]
        self.timings.append(timing)


def _stage_mismatches(stages: list[dict]) -> list[str]:
    """What must be the same on every pipeline rank and is not: autocast, and the parameters' dtypes."""
    out = []
    for key, what in (("autocast", "autocast"), ("dtypes", "floating-point parameter dtypes")):
        values = [json.dumps(s[key]) for s in stages]
        if len(set(values)) > 1:
            out.append(f"{what} differ between pipeline ranks: " +
                       ", ".join(f"rank {r}: {s[key]}" for r, s in enumerate(stages)))
    return out


def _digest(description: dict) -> int:
    """A signed 64-bit digest of a rank's step description, the same in every process."""
    text = json.dumps(description, sort_keys=True).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)


def _ms(pair: tuple[float, float]) -> tuple[float, float]:
    t0 = _rec.active().host_origin
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
