"""A trace's collectives against the model's kinds: which measured kind is which predicted one, which engine
a kind needs, and the exposed time per step each kind cost (calibrate.fit's input)."""

from __future__ import annotations

from .collectives import Collectives

KIND_COLLECTIVE = {"tp_all_gather": "all_gather", "tp_reduce_scatter": "reduce_scatter", "tp_all_reduce": "all_reduce",
                   "dp_all_reduce": "all_reduce", "dp_reduce_scatter": "reduce_scatter",
                   "zero_all_gather": "all_gather", "pp_send": "send_recv", "ep_all_to_all": "all_to_all",
                   "cp_kv": "send_recv"}
"""The collective each communication kind of a prediction runs."""
ENGINE_OF = {"tp_": "tp", "dp_": "dp", "zero_": "dp", "pp_": "pp", "ep_": "ep", "cp_": "cp"}
"""An overlapkit kind's prefix -> the layout's degree its collectives need (> 1) to run at all."""


def engine_of(kind: str) -> str | None:
    """The layout degree (tp, dp, pp, ep, cp) an overlapkit kind needs; None for a kind no engine names."""
    return next((e for prefix, e in ENGINE_OF.items() if kind.startswith(prefix)), None)


def model_kind(kind: str, predicted: dict, measured_kinds=()) -> str | None:
    """The prediction's kind for a measured one: the same name, or the one kind ending in _<collective>. A
    collective named only by the trace (`all_gather`) in a trace where overlapkit named its own is other code's
    (a pipeline's per-step shape check, a metric's reduction): none."""
    if kind in KIND_COLLECTIVE:
        return kind
    if engine_of(kind) is None and any(engine_of(k) is not None for k in measured_kinds):
        return None
    matches = [k for k in predicted if k.endswith("_" + kind)]
    return matches[0] if len(matches) == 1 else None


def traced_comm(measured, predicted: dict, notes: list) -> tuple[dict, float, dict]:
    """({the model's kind: [comm ms, exposed ms]} measured per step, exposed ms of kinds the model lacks that no
    engine names, {engine kind the model lacks: exposed ms per step}) of `measured` (a calibrate.Measured)."""
    by_kind: dict[str, list[float]] = {}
    unmatched, engine_exposed = 0.0, {}
    for kind, (comm_ms, exposed_ms, _calls, _nbytes) in measured.comm.items():
        ours = model_kind(kind, predicted, measured.comm)
        if ours is None or predicted.get(ours, 0.0) <= 0 or comm_ms <= 0:
            if engine_of(kind) is not None:
                # e.g. the vocabulary-parallel loss's and the sequence-parallel norms' TP all-reduces: they run
                # where that engine runs, as often as its layers and micro-batches, not once per host op
                notes.append(f"traced {kind} ({comm_ms:.3g} ms per step, {exposed_ms:.3g} exposed) has no counterpart "
                             f"in the model: its exposed time is priced wherever {engine_of(kind)} > 1, per layer and "
                             f"micro-batch")
                engine_exposed[kind] = engine_exposed.get(kind, 0.0) + exposed_ms
                continue
            notes.append(f"traced {kind} ({comm_ms:.3g} ms per step, {exposed_ms:.3g} exposed) has no counterpart "
                         f"in the model of this layout: its exposed time counts as host time")
            unmatched += exposed_ms
            continue
        got = by_kind.setdefault(ours, [0.0, 0.0])
        got[0] += comm_ms
        got[1] += exposed_ms
    for kind, ms in predicted.items():
        if kind not in by_kind and ms > 0:
            notes.append(f"the traced layout's model has {kind} ({ms:.3g} ms per step) that the trace does not show: "
                         f"priced as the model does (does --traced describe the traces?)")
    # Kinds exposed at once (a DP all-reduce on its own thread or stream beside a TP gather) cost the step that
    # time once: their exposed times are shared out to add up to the step's exposed time, no more.
    union = measured.step_ms - measured.compute_ms - measured.idle_ms
    total = sum(e for _, e in by_kind.values()) + unmatched + sum(engine_exposed.values())
    if union >= 0 and total > union * (1 + 1e-6):
        share = union / total
        notes.append(f"kinds were exposed at the same time: {total:.3g} ms exposed by kind, {union:.3g} ms of the "
                     f"step; each kind's exposed time x{share:.3g}")
        for got in by_kind.values():
            got[1] *= share
        unmatched, engine_exposed = unmatched * share, {k: e * share for k, e in engine_exposed.items()}
    return by_kind, unmatched, engine_exposed


class PerCallCollectives(Collectives):
    """Each collective in `per_call` (collective -> ms) a fixed time per call, whatever its bytes and group; the
    others as the base model prices them (`counting`: 1 ms for every call, so that `comm_by_kind` counts calls).
    Gloo's collectives on a CPU at the sizes a layer moves are rendezvous-bound: each call waits for the slowest
    rank to arrive and hands off between threads, so their time follows the number of calls, not the ring's bytes
    (the 16 cores' calibration runs: a TP all-gather at tp 4 and twice the micro-batch took what it took at tp 2,
    a DP all-reduce of 3x the bytes the same time). Larger messages are bandwidth-bound again (EP chunks at 4096
    tokens on 8 ranks): where a job's collectives are, this prices them too cheap as the bytes grow."""

    def __init__(self, hardware, per_call: dict, counting: bool = False) -> None:
        super().__init__(hardware)
        self.per_call, self.counting = dict(per_call), counting

    def time_ms(self, kind: str, nbytes: float, group, algo: str = "auto") -> float:
        if nbytes <= 0 or (group.size <= 1 and kind != "send_recv"):
            return 0.0
        if self.counting:
            return 1.0
        return self.per_call[kind] if kind in self.per_call else super().time_ms(kind, nbytes, group, algo)


def model_calls(predict_fn, model, par, hardware) -> dict:
    """The model's collective calls per step by kind at `par` (`predict_fn`: step.predict, passed in so this module
    stays below the step model)."""
    return predict_fn(model, par, hardware, PerCallCollectives(hardware, {}, counting=True)).comm_by_kind


def per_call_ms(by_kind: dict, calls: dict) -> dict:
    """Collective -> measured ms per call of the model's, from `by_kind` (traced_comm's) and the model's calls per
    kind at the traced layout (`comm_by_kind` under PerCallCollectives with no times)."""
    sums: dict[str, list[float]] = {}
    for kind, (comm_ms, _) in by_kind.items():
        got = sums.setdefault(KIND_COLLECTIVE[kind], [0.0, 0.0])
        got[0] += comm_ms
        got[1] += calls.get(kind, 0.0)
    return {c: ms / n for c, (ms, n) in sums.items() if n > 0}


def call_map(measured, calls: dict) -> dict:
    """Traced kind -> (calls per step, the model's kind or '', the model's calls of it at the traced layout): how
    each traced kind's calls follow the layout (`calls_at`)."""
    out = {}
    for kind, (_comm, _exp, n, _nbytes) in measured.comm.items():
        ours = model_kind(kind, calls, measured.comm)
        out[kind] = (n, ours, calls[ours]) if ours and calls.get(ours, 0.0) > 0 else (n, "", 0.0)
    return out


def calls_at(mapping: dict, calls: dict, par, per_op: float) -> float:
    """Collective calls per step at layout `par` (the model's `calls` there): a kind the model prices as the
    model's count grows; an engine's kind the model lacks per layer and micro-batch (`per_op`: ops here over
    the traced layout's) where that engine runs; other code's as traced."""
    total = 0.0
    for kind, (n, ours, traced) in mapping.items():
        if ours:
            total += n * calls.get(ours, 0.0) / traced
        elif engine_of(kind) is not None:
            total += n * per_op if getattr(par, engine_of(kind)) > 1 else 0.0
        else:
            total += n
    return total
