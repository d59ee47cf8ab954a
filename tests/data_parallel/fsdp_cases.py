"""Per-rank bodies of the ZeRO-3 (fully_shard) tests: one spawn per world size runs every case.

Each case trains the same model on every rank, each rank its slice of one global batch, and
compares with one process on the whole batch and with torch's plain FSDP2 on the same slices.
"""

from __future__ import annotations

import collections
import gc
import functools
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from distributed import distributed
from step_trace import differences, step_trace
from overlapkit.runtime import tuning
from overlapkit.runtime.agreement import RankMismatchError
from overlapkit.data_parallel import fully_shard, layer_report, prefetch_plan
from overlapkit.data_parallel import fsdp_prefetch
from overlapkit.data_parallel.fsdp_comm import Probe
from overlapkit.timeline import record

PER_RANK = 4
STEPS = 19  # auto: warm-up, probe, 1 + 4 rounds of timing up to 3 depths, then steps at the chosen one
PREFETCH = (0, 1, 2, (1, 2), "auto", "auto, trials")
"""Depths the equality cases run; "auto, trials" is auto with its opt-in trials (trials=4)."""


class Net(nn.Module):
    """Odd widths: no weight's first dim divides by 2 or 3, so every shard is padded."""

    def __init__(self, seed: int = 0, sleep_in: int | None = None, sleep_s: float = 0.3) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(5, 7)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 7)) for _ in range(4))
        self.out = nn.Linear(7, 3)
        self.sleep_in, self.sleep_s, self.slept = sleep_in, sleep_s, None
        self.delay = None  # a callable: seconds to sleep at the start of each forward
        self.back_delay = None  # a callable: seconds to sleep at the end of each backward

    def forward(self, x):
        if self.delay is not None:
            time.sleep(self.delay())
        h = self.inp(x)
        if self.back_delay is not None and h.requires_grad:
            h.register_hook(lambda g: (time.sleep(self.back_delay()), g)[1])
        for i, b in enumerate(self.blocks):
            h = h + b(h)
            if i == self.sleep_in:
                t0 = time.perf_counter()
                time.sleep(self.sleep_s)
                self.slept = (t0, time.perf_counter())
        return self.out(h)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def batch(world: int):
    g = torch.Generator().manual_seed(1)
    return torch.randn(world * PER_RANK, 5, generator=g), torch.randn(world * PER_RANK, 3, generator=g)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def train(model, x, y, steps=STEPS):
    """The last step's gradients and the parameters after `steps` AdamW steps (which every step's gradients shaped)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return [full(p.grad) for p in model.parameters()], [full(p).detach() for p in model.parameters()]


def worst(a, b) -> float:
    return max(rel_err(u, v) for u, v in zip(a, b))


def _equality_cases(rank: int, world: int, mesh, model_fn, x, y, sl) -> dict:
    out = {}
    ref_grads, ref_params = train(model_fn(), x, y)
    plain = model_fn()
    for b in plain.blocks:
        torch_fully_shard(b, mesh=mesh)
    torch_fully_shard(plain, mesh=mesh)
    plain_grads, plain_params = train(plain, x[sl], y[sl])
    for p in PREFETCH:
        m = fully_shard(model_fn(), mesh, prefetch="auto", trials=4) if p == "auto, trials" else \
            fully_shard(model_fn(), mesh, prefetch=p)
        grads, params = train(m, x[sl], y[sl])
        out[f"prefetch={p} vs single process"] = max(worst(grads, ref_grads), worst(params, ref_params))
        out[f"prefetch={p} vs FSDP2"] = max(worst(grads, plain_grads), worst(params, plain_params))
        plan = prefetch_plan(m)
        out[f"prefetch={p} depths"] = (plan.forward_depth, plan.backward_depth, plan.decided)
        out[f"prefetch={p} reason"] = plan.reason
        out[f"prefetch={p} measured"] = plan.measured
    return out


def _memory_case(world: int, mesh) -> dict:
    m = fully_shard(Net(), mesh, prefetch=1)
    x, y = batch(world)
    F.mse_loss(m(x[:PER_RANK]), y[:PER_RANK]).backward()
    total = sum(p.numel() * p.element_size() for p in Net().parameters())
    storages, bound = {}, 0
    for p in m.parameters():
        local = p.to_local()
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
        rows = -(-p.shape[0] // world)  # FSDP2 pads dim 0 to a multiple of the DP size
        bound += rows * (p.numel() // p.shape[0]) * p.element_size()
    return {"param bytes per rank": sum(storages.values()), "model param bytes": total, "padded bound": bound,
            "all sharded": all(isinstance(p, DTensor) and p.placements[0].is_shard() for p in m.parameters())}


def _overlap_case(world: int, mesh) -> dict:
    """A 0.3 s sleep after block 1 (50 ms longer on each later rank): with prefetch 1, block 2's
    gather (issued in block 1's pre-forward) lands during it; with prefetch 0 it starts after it,
    and a rank whose peer still sleeps waits for it. (Equal sleeps let the ranks leave together,
    and a gather that short could hide inside the next compute span: exposed 0, a flaky check.)"""
    out = {}
    x, y = batch(world)
    for depth in (0, 1):
        m = fully_shard(Net(sleep_in=1, sleep_s=0.3 + 0.05 * dist.get_rank()), mesh, prefetch=depth)
        F.mse_loss(m(x[:PER_RANK]), y[:PER_RANK]).backward()  # warm-up
        with record() as rec:
            rec.next_step()
            F.mse_loss(m(x[:PER_RANK]), y[:PER_RANK]).backward()
        t0 = rec.host_origin
        slept = [(a - t0) * 1e3 for a in m.slept]
        gather = [s for s in rec.spans if s.kind == "zero_all_gather" and s.name == "blocks.2 forward"]
        out[f"depth {depth} gather"] = (gather[0].start_ms, gather[0].end_ms) if gather else None
        out[f"depth {depth} sleep"] = tuple(slept)
        rows = {r.name: r for r in layer_report(rec.spans)}
        out[f"depth {depth} blocks.2 exposed"] = rows["blocks.2"].forward_gather_exposed_ms
        out[f"depth {depth} blocks.2 gather ms"] = rows["blocks.2"].forward_gather_ms
        out[f"depth {depth} kinds"] = sorted({s.kind for s in rec.spans})
    return out


def _unit_names(model) -> dict[int, str]:
    """FSDP2 state id -> block name ("" for the root)."""
    named = dict(model.named_modules())
    return {id(named[n]._get_fsdp_state()): n for n in ["", *prefetch_plan(model).units]}


def _issued(model, x, y) -> dict:
    """What one step of `model` issues: its collectives in issue order and FSDP2's prefetch lists."""
    names = _unit_names(model)
    named = dict(model.named_modules())
    lists = {}
    for n in names.values():
        state = named[n]._get_fsdp_state()
        lists[n] = ([names[id(s)] for s in state._states_to_forward_prefetch],
                    [names[id(s)] for s in state._states_to_backward_prefetch])
    with record() as rec:
        rec.next_step()
        F.mse_loss(model(x), y).backward()
    comms = [(s.kind, s.name) for s in sorted(rec.spans, key=lambda s: s.start_ms) if not s.is_compute]
    return {"comms": comms, "lists": lists, "probe stamps": len(model._overlapkit_zero3.probe.comms)}


def _python_calls(model, x, y) -> collections.Counter:
    """(file, function) -> calls of one unrecorded step, while any clock auto times with raises."""
    calls: collections.Counter = collections.Counter()

    def count(frame, event, _arg):
        # weakref callbacks run whenever the collector frees what an earlier step left: not this step's calls
        if event == "call" and not frame.f_code.co_filename.endswith(("weakref.py", "_weakrefset.py")):
            calls[(frame.f_code.co_filename, frame.f_code.co_name)] += 1

    def no_clock(*_):
        raise AssertionError("auto read a clock after deciding")
    stamps = tuning._stamp, Probe.stamp
    tuning._stamp, Probe.stamp = no_clock, no_clock
    gc.collect()
    sys.setprofile(count)
    try:
        F.mse_loss(model(x), y).backward()
    finally:
        sys.setprofile(None)
        tuning._stamp, Probe.stamp = stamps
    return calls


def _state(model) -> dict:
    """What a step leaves behind on the host: hooks per module, each FSDP2 unit's state, auto's."""
    out = {}
    for n, m in model.named_modules():
        hooks = tuple(len(h) for h in (m._forward_pre_hooks, m._forward_hooks, m._backward_hooks,
                                       m._backward_pre_hooks))
        group = getattr(m._get_fsdp_state(), "_fsdp_param_group", None) if hasattr(m, "_get_fsdp_state") else None
        fsdp = None if group is None else (
            str(group._training_state), group.is_sharded, group._all_gather_result is not None,
            group.post_forward_mesh_info is not None, tuple(str(p.sharded_state) for p in group.fsdp_params))
        out[n] = (hooks, fsdp)
    z = model._overlapkit_zero3
    out["zero3"] = (z._pending, z._in_backward, len(z._spans), z.choice, z._trial, z._region, z.probe.on, len(z.probe.comms))
    return out


def _decided_case(world: int, mesh) -> dict:
    """After auto decides, it is the fixed model at its depths: the same collectives, in the same
    order, with the same FSDP2 prefetch lists, and nothing of the probe or trials left."""
    x, y = batch(world)
    x, y = x[:PER_RANK], y[:PER_RANK]
    auto = fully_shard(Net(), mesh, prefetch="auto", trials=4)
    steps = 0
    while not prefetch_plan(auto).decided and steps < 30:
        F.mse_loss(auto(x), y).backward()
        steps += 1
    plan = prefetch_plan(auto)
    fixed = fully_shard(Net(), mesh, prefetch=(plan.forward_depth, plan.backward_depth))
    F.mse_loss(fixed(x), y).backward()  # lazy init, as auto had
    # The step that decided ran its forward at the kept depths; it and the two after it leave the
    # same FSDP2 and hook state as the fixed model's steps.
    states = [_state(auto) == _state(fixed)]
    for _ in range(2):
        F.mse_loss(auto(x), y).backward()
        F.mse_loss(fixed(x), y).backward()
        states.append(_state(auto) == _state(fixed))
    auto_calls, fixed_calls = _python_calls(auto, x, y), _python_calls(fixed, x, y)
    traces = [step_trace(m, lambda m=m: F.mse_loss(m(x), y).backward()) for m in (auto, fixed)]
    return {"trace differences": differences(*traces), "trace sizes": {k: len(v) for k, v in traces[0].items()},
            "held": traces[0]["held"], "decided after": steps, "auto decided": plan.decided, "same state after each step": states,
            "state": _state(auto),
            "auto depths": (plan.forward_depth, plan.backward_depth),
            "auto issues": _issued(auto, x, y), "fixed issues": _issued(fixed, x, y),
            "python calls": (sum(auto_calls.values()), sum(fixed_calls.values())),
            "python calls that differ": {f"{k[0]}:{k[1]}": (auto_calls[k], fixed_calls[k])
                                         for k in auto_calls.keys() | fixed_calls.keys()
                                         if auto_calls[k] != fixed_calls[k]}}


def _trials_case(world: int, mesh) -> dict:
    """auto's trials keep what they measured, the forward depth by the forwards and the backward depth
    by the backwards: every candidate but the deepest is slowed by 40 ms a forward, every one but
    the shallowest by 40 ms a backward (on every rank), so the deepest forward depth and the
    shallowest backward depth are faster in every round and must be kept, and run, whatever the
    model picked."""
    x, y = batch(world)
    x, y = x[:PER_RANK], y[:PER_RANK]
    real_tie, fsdp_prefetch.TIE = fsdp_prefetch.TIE, 100.0  # every neighbour of the model's pick is timed
    try:
        auto = fully_shard(Net(), mesh, prefetch="auto", trials=4)
        state, ran = auto._overlapkit_zero3, []

        def delay(fastest) -> float:
            if state.choice is None or state._trial is None:
                return 0.0
            return 0.0 if state._trial.choice == fastest(state.choice.candidates) else 0.04

        def forward_delay() -> float:
            if state._trial is not None:
                ran.append(state._trial.choice)
            return delay(max)
        auto.delay, auto.back_delay = forward_delay, lambda: delay(min)
        steps = 0
        while not prefetch_plan(auto).decided and steps < 30:
            F.mse_loss(auto(x), y).backward()
            steps += 1
    finally:
        fsdp_prefetch.TIE = real_tie
    plan = prefetch_plan(auto)
    fixed = fully_shard(Net(), mesh, prefetch=(plan.forward_depth, plan.backward_depth))
    F.mse_loss(fixed(x), y).backward()
    return {"trials ran": ran, "trials kept": (plan.forward_depth, plan.backward_depth), "trials measured": plan.measured,
            "trials reason": plan.reason, "trials lists": (_issued(auto, x, y)["lists"], _issued(fixed, x, y)["lists"])}


def _bad_input_cases(rank: int, world: int, mesh) -> dict:
    out = {}
    cases = {
        "prefetch=-1 everywhere": dict(prefetch=-1),
        "prefetch=-1 on the last rank": dict(prefetch=-1 if rank == world - 1 else 1),
        "prefetch differs": dict(prefetch=rank),
        "prefetch pair with -1": dict(prefetch=(1, -1)),
        "wrap names no module": dict(wrap="nope"),
        "wrap names no module on rank 0": dict(wrap="nope" if rank == 0 else None),
    }
    for name, kw in cases.items():
        t0 = time.perf_counter()
        try:
            fully_shard(Net(), mesh, **kw)
            out[name] = None
        except RankMismatchError as e:
            out[name] = ("RankMismatchError", str(e))
        except ValueError as e:
            out[name] = ("ValueError", str(e))
        out[name + " seconds"] = time.perf_counter() - t0
    t = torch.ones(1)
    dist.all_reduce(t)  # the group still pairs after every refusal
    out["after bad input, sum"] = t.item()
    return out


def _run(cases: tuple[str, ...]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    x, y = batch(world)
    sl = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    out = {}
    if "equal" in cases:
        out.update(_equality_cases(rank, world, mesh, Net, x, y, sl))
    if "memory" in cases:
        out.update(_memory_case(world, mesh))
    if "overlap" in cases:
        out.update(_overlap_case(world, mesh))
    if "decided" in cases:
        out.update(_decided_case(world, mesh))
    if "trials" in cases:
        out.update(_trials_case(world, mesh))
    if "bad" in cases:
        out.update(_bad_input_cases(rank, world, mesh))
    return out


@distributed(world_size=2, timeout_s=60.0)
def _two():
    return _run(("equal", "memory", "overlap", "decided", "trials", "bad"))


@distributed(world_size=3, timeout_s=60.0)
def _three():
    return _run(("equal", "memory", "decided", "bad"))


@functools.cache
def results(world: int) -> list[dict]:
    return _two() if world == 2 else _three()
