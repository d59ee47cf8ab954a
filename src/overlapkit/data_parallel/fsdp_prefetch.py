"""The prefetch `fully_shard` runs: FSDP2's explicit prefetch lists set to a depth, so each block's
parameter all-gather overlaps the compute of the blocks before it (in backward: after it, and
its reduce-scatter); and how `prefetch="auto"` chooses that depth.

auto, step by step (steps count finished backwards; a pipeline stage runs several forwards per
backward, so a "step" here is a window from a forward to the end of the next backward):
1. until `probe_step`: depth 0 (warm-up);
2. the probe window, at depth 0: every gather is waited right after issue, so compute, gathers
   and reduce-scatters are timed alone (fsdp_comm.Probe); the ranks take the slowest rank's
   times and `costmodel.fsdp_prefetch_choice` prices every depth;
3. `trials` rounds, one window per candidate: the model's pick and the neighbouring depths
   (one shallower, one deeper, within memory) that it prices within TIE of its pick. The model
   has one communication stream; gloo runs two collectives at once and NCCL's streams contend
   with compute in ways it does not price, so near-ties are settled by the clock
   (`overlapkit.tuning.MeasuredChoice`, which the other engines' `auto` use too);
4. the model's pick, unless a neighbour was faster than it in at least three rounds in four and
   by more than MIN_GAIN in the median of the per-round ratios (each call timed as the slowest
   rank's: one all-reduce of every call's time); the trials start with one untimed round. The
   rule runs on the forward passes' times for the forward depth and on the backward's for the
   backward depth (the cost model prices them apart too), so (1, 2) and (2, 3) timed can keep (2, 2).
Every decision is taken from all-reduced numbers, so every rank switches depth at the same window.
After it, a step of an auto model runs what a model fixed at its depths runs: the same hooks and
Python calls, the same collectives, no clock read (tests/data_parallel/test_fsdp.py counts them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime import comm
from ..timeline.fsdp2 import ROOT
from ..runtime.recorder import compute_span
from ..runtime.tuning import MeasuredChoice
from .fsdp_comm import Probe, RecordedAllGather, RecordedReduceScatter

MIB = 1024 * 1024
TIE = 0.10
"""Depths the model prices within this share of its pick are timed against it."""
MIN_GAIN = 0.01
"""A neighbour of the model's pick must be measured this much faster (median per-round ratio) to displace it."""

_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


class ZeroThree:
    """The prefetch lists, the timeline's view of FSDP2's communication, and auto's probe and trials."""

    def __init__(self, root, units, names, plan, group, device_type: str, cfg, check) -> None:
        self.root, self.units, self.group, self.cfg, self.plan = root, units, group, cfg, plan
        self.check = check
        self.device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" \
            else torch.device(device_type)
        self.probe = Probe(self.device)
        for m, name in [(root, ROOT), *zip(units, names)]:
            m.set_custom_all_gather(RecordedAllGather(name, self.probe))
            m.set_custom_reduce_scatter(RecordedReduceScatter(name, self.probe))
        self._apply(plan.forward_depth, plan.backward_depth)
        self.steps = 0
        self._pending = None  # what the next pre-forward decides: "model" or "trials"
        self._in_backward = False
        self._spans: dict[str, object] = {}
        self.choice: MeasuredChoice | None = None  # auto's trials of the model's near-ties, while they last
        self._trial = None  # the trial of the window in progress (its forwards to the end of the next backward)
        self._region = None  # the trial's timing context of the pass in progress
        self._model_reason = ""
        root.register_forward_pre_hook(self._pre_forward, prepend=True)  # before FSDP2's root pre-forward
        root.register_forward_hook(self._post_forward)  # after FSDP2's post-forward
        for i, u in enumerate(units):  # before FSDP2's pre-forward of the block, which issues its gather
            u.register_forward_pre_hook(lambda _m, _args, i=i: self.check.block(i), prepend=True)

    def _apply(self, forward: int, backward: int) -> None:
        units, root = self.units, self.root
        for i, u in enumerate(units):
            u.set_modules_to_forward_prefetch(units[i + 1:i + 1 + forward])
        root.set_modules_to_forward_prefetch(units[:forward])
        rev = units[::-1]
        # An empty backward list means FSDP2's default (prefetch one); naming the module itself
        # is a no-op prefetch (it is already gathered when its pre-backward runs): depth 0.
        for i, u in enumerate(rev):
            u.set_modules_to_backward_prefetch(rev[i + 1:i + 1 + backward] or [u])
        root.set_modules_to_backward_prefetch(rev[:backward] or [root])
        self.plan.forward_depth, self.plan.backward_depth = forward, backward

    # -- hooks ------------------------------------------------------------------------------
    def _open(self, name: str) -> None:
        span = compute_span(f"zero3 {name}")
        span.__enter__()
        self._spans[name] = span
        if self.probe.on:
            self.probe.passes[name].append([self.probe.stamp(), None])

    def _close(self, name: str) -> None:
        span = self._spans.pop(name, None)
        if span is not None:
            span.__exit__(None, None, None)
        if self.probe.on and self.probe.passes[name] and self.probe.passes[name][-1][1] is None:
            self.probe.passes[name][-1][1] = self.probe.stamp()

    def _pre_forward(self, _module, _args) -> None:
        self.check.model()
        self.check.forward_starts()
        if self._pending is not None:
            self._pending = None
            self._decide_by_model()
        if torch.is_grad_enabled() and not self.plan.decided:
            self._measure()
        self._open("forward")

    def _measure(self) -> None:
        """auto, at a training forward: start the probe window or the next trial window, or keep the trials' pick."""
        if self.choice is not None:
            if self._trial is None:  # a pipeline stage runs several forwards in one window
                self._trial = self.choice.trial(self.device)  # the call after the last window decides (collective)
                if self._trial is None:
                    self._finish_trials()
                else:
                    self._apply(*self._trial.choice)
            if self._trial is not None:  # each forward of the window a region: a window's passes add up
                self._timing(self._trial.forward())
        elif not self.probe.on and self.steps >= self.cfg.probe_step:  # `>=`: a stage may step over probe_step
            self.probe.reset()
            self.probe.on = True

    def _post_forward(self, _module, _args, output):
        self._close("forward")
        if self._region is not None:
            self._timing(None)
        self.check.forward_ends()
        if not torch.is_grad_enabled():
            return output
        for t in torch.utils._pytree.tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._begin_backward)
        return output

    def _begin_backward(self, _grad) -> None:
        if self._in_backward:
            return
        self._in_backward = True
        _queue_callback(self._end_backward)
        self._open("backward")
        if self._trial is not None:
            self._timing(self._trial.backward())

    def _end_backward(self) -> None:
        self._close("backward")
        self._in_backward = False
        if self.probe.on:
            self.probe.on = False
            self._pending = "model"
        elif self._trial is not None:
            self._timing(None)
            self._trial = None
        self.steps += 1

    def _timing(self, region) -> None:
        """End the trial's timing region in progress, if any, and start `region` (None: none)."""
        if self._region is not None:
            self._region.__exit__(None, None, None)
        self._region = region
        if region is not None:
            region.__enter__()

    # -- auto ------------------------------------------------------------------------------
    def _slowest(self, values: list[float], name: str) -> list[float]:
        """The slowest rank's value of each entry, on every rank (the same inputs give the same depths)."""
        vals = torch.tensor(values, dtype=torch.float64, device=self.device)
        comm.all_reduce(vals, self.group, kind="dp_all_reduce", name=name, op=dist.ReduceOp.MAX, async_op=False)
        return vals.tolist()

    def _decide_by_model(self) -> None:
        from ..costmodel.fsdp import fsdp_prefetch_choice, prefetch_wall_ms

        t = self.probe.times()
        n = max(1, len(self.units))
        # Per block and pass: the probe window holds one backward and one or more forwards.
        fwd_ms, gather_ms, bwd_ms, bwd_gather_ms, reduce_ms = self._slowest([
            max(0.0, t["forward_wall_ms"] - t["forward_stall_ms"]) / (n * max(1.0, t["forward_passes"])),
            t["forward_gather_ms"],
            max(0.0, t["backward_wall_ms"] - t["backward_stall_ms"]) / (n * max(1.0, t["backward_passes"])),
            t["backward_gather_ms"], t["backward_reduce_ms"]], "zero3-auto-probe")
        self.plan.probe = dict(zip(("forward_compute_ms_per_block", "forward_gather_ms", "backward_compute_ms_per_block",
                                    "backward_gather_ms", "reduce_scatter_ms"), (fwd_ms, gather_ms, bwd_ms,
                                                                                 bwd_gather_ms, reduce_ms)))
        layer_bytes = max(self.plan.unit_param_bytes, default=0)
        budget, units, top = self.plan.memory_budget_bytes, len(self.units), self.cfg.max_depth
        if not self.units:
            self._finish(0, 0, "")
            return
        fd, fwhy = fsdp_prefetch_choice(fwd_ms, gather_ms, layer_bytes, budget, num_layers=units, max_depth=top)
        bd, bwhy = fsdp_prefetch_choice(bwd_ms, bwd_gather_ms, layer_bytes, budget, num_layers=units,
                                        reduce_ms=reduce_ms, max_depth=top)
        self._model_reason = f"model: forward {fwhy}; backward {bwhy}"

        def fits(d: int) -> bool:
            return 0 <= d <= min(top, units) and (budget is None or d * layer_bytes <= budget)

        def wall(f: int, b: int) -> float:
            return (prefetch_wall_ms(fwd_ms, gather_ms, f, num_layers=units)
                    + prefetch_wall_ms(bwd_ms, bwd_gather_ms, b, num_layers=units, reduce_ms=reduce_ms))

        picked = wall(fd, bd)
        candidates = [(fd, bd)] + [(fd + k, bd + k) for k in (-1, 1)
                                   if fits(fd + k) and fits(bd + k) and wall(fd + k, bd + k) <= picked * (1 + TIE)]
        if self.cfg.trials == 0 or len(candidates) == 1:
            self._finish(fd, bd, "")
            return
        # The model's pick first: a neighbour displaces it only by being faster round after round
        # (paired), so depths whose gap is below the rounds' spread keep what the model priced.
        # One warm-up round: the first window after the probe and each first deeper window allocate.
        self.choice = MeasuredChoice(candidates, self.group, what="zero3-prefetch", kind="dp_all_reduce",
                                     rounds=self.cfg.trials, warmup_rounds=1, tie=MIN_GAIN, paired=True)
        self.plan.reason = (f"{self._model_reason}; timing depths {candidates} for 1 + {self.cfg.trials} "
                            "interleaved rounds")

    def _finish_trials(self) -> None:
        (fd, bd), measured, why = self.choice.decided, self.choice.measured, self.choice.reason
        if self.choice.per_phase:  # forward and backward depth each from its own pass's times
            fd, bd = self.choice.per_phase["forward"][0], self.choice.per_phase["backward"][1]
            why += f"; by pass: forward depth {fd} (of {self.choice.per_phase['forward']}), backward depth {bd}"
        self.choice = None
        self.plan.measured = {f"{f}/{b}": ms for (f, b), ms in measured.items()}
        shown = ", ".join(f"{f}/{b}: {ms:.3g} ms" for (f, b), ms in measured.items())
        self._finish(fd, bd, f"; measured step (forward/backward depth: median ms, slowest rank) {shown} "
                             f"({why})")

    def _finish(self, fd: int, bd: int, measured: str) -> None:
        self._apply(fd, bd)
        self.probe.reset()  # the probe's stamps are read: from here on an auto model is a fixed one
        self.plan.decided = True
        held = self.plan.held_ahead_bytes(max(fd, bd)) / MIB
        budget = self.plan.memory_budget_bytes
        self.plan.reason = (f"{self._model_reason or 'no blocks to prefetch'}{measured}; holds "
                            f"{held:.3g} MiB of gathered parameters ahead"
                            + ("" if budget is None else f" (budget {budget / MIB:.3g} MiB)"))
