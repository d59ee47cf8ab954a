"""The host term of a calibration on a GPU: the dispatch time per op (and the idle it does not explain).

On a GPU the host dispatches ahead and the GPU waits only where the dispatch has fallen behind its work over the
step so far (costmodel.host_queue). `measured_dispatch` reads the dispatch off the host's own busy time in the trace;
`bisected_dispatch`, for a trace without it, sets the dispatch at which the model's wait is the traced idle.
"""

from __future__ import annotations

from dataclasses import replace

from .hardware import Hardware
from .model import ModelConfig
from .parallel import ParallelConfig
from .step import HOST_OPS_PER_LAYER, predict

FIT_STEPS = 60
"""Bisection steps of the fits (the compute rate in log scale over 1e-12..1e6 times the preset's, the dispatch time
over 0..1e5 µs): 60 halvings leave a relative error below 1e-7."""


def bisect(ok, lo: float, hi: float) -> tuple[float, float]:
    """(lo, hi) after FIT_STEPS halvings of [lo, hi] that keep `ok(lo)` true and `ok(hi)` false (`ok` monotone)."""
    for _ in range(FIT_STEPS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo, hi


def ops_per_step(model: ModelConfig, par: ParallelConfig) -> int:
    """Framework ops the slowest stage's host dispatches in one step (forward and twice that backward)."""
    layers = max(par.stage_layers(model.num_layers))
    return 3 * HOST_OPS_PER_LAYER[par.eager] * layers * par.micro_batches


def measured_dispatch(host_busy_ms: float, idle_ms: float, model: ModelConfig, traced: ParallelConfig, hw: Hardware,
                      notes: list) -> tuple[float, float]:
    """(dispatch µs per op, fixed ms per step) on a GPU whose trace shows the host's own time. The dispatch is
    read off the host side, not inferred from where the GPU waited: a trace in which the GPU never waited for a
    layer says only that dispatch was faster than the GPU there, and an idle time that does not change with the
    work (the step's edges) is not dispatch. The host's busy time holds both: the layers' dispatch, and the
    per-step work the GPU sat idle through (the idle the layers' dispatch does not explain, priced once per
    step). So the dispatch is the busy time less that per-step part, over the ops dispatched; and the per-step
    part is the idle less the model's wait at that dispatch time: solved together (bisected: the busy time they
    add up to grows with the dispatch time)."""
    ops = ops_per_step(model, traced)

    def wait_ms(us: float) -> float:
        return predict(model, traced, replace(hw, host_us_per_op=us)).host_ms

    def busy_ms(us: float) -> float:  # the busy time a dispatch of `us` per op implies, with its per-step parts
        return 1e-3 * us * ops + hw.optimizer_host_ms + max(0.0, idle_ms - wait_ms(us))

    lo, _ = bisect(lambda us: busy_ms(us) <= host_busy_ms, 0.0, 1e3 * host_busy_ms / ops)
    wait = wait_ms(lo)
    fixed = max(0.0, idle_ms - wait)
    opt = f", {hw.optimizer_host_ms:.3g} ms in the optimizer's step" if hw.optimizer_host_ms else ""
    notes.append(f"the host was busy {host_busy_ms:.3g} ms per step: {1e-3 * lo * ops:.3g} ms dispatching the "
                 f"layers' ops ({lo:.3g} us per op){opt} and {fixed:.3g} ms of per-step work the GPU sat idle through; the "
                 f"layers' dispatch explains {min(wait, idle_ms):.3g} ms of the GPU's {idle_ms:.3g} ms idle")
    return lo, fixed


def bisected_dispatch(idle_ms: float, model: ModelConfig, traced: ParallelConfig, hw: Hardware, preset_us: float,
                      notes: list) -> float:
    """The host's dispatch time per op on a GPU: where the trace shows the GPU waiting (`idle_ms`), the time
    at which the model's host wait of the traced layout is that idle time; where it shows none, the
    dispatch was no slower than the GPU's work, which bounds it from above only: the preset's time, or
    that bound where it is lower."""
    def wait_ms(us: float) -> float:
        return predict(model, traced, replace(hw, host_us_per_op=us)).host_ms

    lo, _ = bisect(lambda us: wait_ms(us) <= idle_ms, 0.0, 1e5)  # µs per op; the wait grows with it
    if idle_ms > 0 and wait_ms(lo) > 0:
        notes.append(f"the GPU waited {idle_ms:.3g} ms per step for its host: {lo:.3g} us per dispatched op")
        return lo
    notes.append(f"the GPU never waited for its host: dispatch at most {lo:.3g} us per op; priced at "
                 f"{min(lo, preset_us):.3g} us (the preset's {preset_us:.3g} us or that bound)")
    return min(lo, preset_us)
