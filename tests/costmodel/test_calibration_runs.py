"""The committed calibration runs priced again by the model as it is: what `fit` learns from one traced layout of a
real run, and how far each other measured layout of that run lands (issue 43's targets: 5 % on the GPU at world size
1, 10 % on the 16 cores)."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from overlapkit.costmodel import ModelConfig, Overlap, ParallelConfig, preset
from overlapkit.costmodel.calibrate import Measured, fit, predict_calibrated

RUNS = json.loads((Path(__file__).resolve().parents[1] / "data" / "calibration" /
                   "calibrate_validation_rows.json").read_text())["runs"]


def _layout(row: dict, run: dict) -> ParallelConfig:
    """The layout as calibrate_validation stepped it (eager, gradients kept, autocast on the GPU)."""
    tp, dp, mb = row["tp"], row["dp"], row["micro_batch"]
    return ParallelConfig(tp=tp, pp=row["pp"], dp=dp, micro_batch=mb, global_batch=mb * row["micro_batches"] * dp,
                          sp=tp > 1, overlap=Overlap(tp=run["overlap"], dp="bulk", pp="bulk"), eager=True,
                          grad_accumulation="kept", weights="autocast" if run["device"] == "cuda" else "master")


def _errors(run: dict, **measured) -> dict:
    """layout -> % error of its calibrated prediction (the traced layout's first)."""
    model, cal, out = ModelConfig(**run["model"]), None, {}
    for row in run["rows"]:
        got = Measured.from_record({**row["measured"], **measured})
        par = _layout(row, run)
        if row["traced"]:
            cal = fit(got, model, par, preset("h200-sxm"))
        out[row["layout"]] = 100 * (predict_calibrated(cal, model, par).step_ms - got.step_ms) / got.step_ms
    return out


def test_the_gpu_calibration_holds_every_micro_batch_within_five_percent():
    errors = _errors(RUNS["cuda_h100_gpt_alone"])
    assert len(errors) == 4 and all(abs(e) <= 5.0 for e in errors.values()), errors


@pytest.mark.parametrize("run", ["cpu16_gpt", "cpu16_llama"])
def test_gloo_collectives_priced_per_call_beat_pricing_them_per_byte(run):
    """Gloo's collectives at a layer's sizes took the same time a call at 3x the bytes (a rendezvous of the ranks,
    thread handoffs around it): priced per call, each other layout of the 16 cores' runs lands nearer than priced
    per byte (the α-β model scaled), and the traced layout is itself. Both still miss the 10 % target (docs/model.md
    says where: tp 4's compute, dp 4's exposure, pp 2 x tp 2's sends)."""
    calls, by_bytes = _errors(RUNS[run]), _errors(RUNS[run], comm_follows="bytes")
    traced = next(iter(calls))
    assert abs(calls[traced]) < 1.0
    others = [k for k in calls if k != traced]
    mean = {d: sum(abs(e[k]) for k in others) / len(others) for d, e in (("calls", calls), ("bytes", by_bytes))}
    assert mean["calls"] < mean["bytes"] - 5.0, mean
    assert max(abs(calls[k]) for k in others) < max(abs(by_bytes[k]) for k in others)


def test_a_per_call_machine_is_recovered_whatever_the_bytes():
    """A 'trace' made by the model on a machine whose collectives take 3 ms a call and whose host idles 0.5 ms
    around each: the calibrated prediction of a layout moving twice the bytes per call keeps 3 ms a call, and a
    layout without TP loses the TP calls' idle."""
    from overlapkit.costmodel import predict
    from overlapkit.costmodel.traced_comm import PerCallCollectives, model_calls

    model = ModelConfig(hidden=1024, ffn_hidden=4096, num_layers=4, num_heads=16, seq_len=1024, vocab_size=8192,
                        gated_mlp=False)
    hw = preset("h200-sxm")
    truth = PerCallCollectives(hw, {"all_gather": 3.0, "reduce_scatter": 3.0, "all_reduce": 3.0})
    traced = ParallelConfig(tp=2, dp=2, global_batch=4, sp=True)
    r = predict(model, traced, hw, truth)
    calls = model_calls(predict, model, traced, hw)
    comm = {k: (c, r.exposed_by_kind[k], calls[k], 0) for k, c in r.comm_by_kind.items()}
    idle = 0.5 * sum(calls.values())
    cal = fit(Measured(step_ms=r.step_ms + idle, compute_ms=r.compute_ms, idle_ms=idle, comm=comm,
                       comm_follows="calls"), model, traced, hw)
    assert cal.comm_per_call == pytest.approx({"all_gather": 3.0, "reduce_scatter": 3.0, "all_reduce": 3.0})
    assert cal.host_ms_per_call == pytest.approx(0.5)
    wider = replace(traced, micro_batch=2, global_batch=8)  # twice the bytes a call, the same calls
    got = predict_calibrated(cal, model, wider)
    for kind, ms in predict(model, wider, hw, truth).comm_by_kind.items():
        assert got.comm_by_kind[kind] == pytest.approx(ms), kind
    assert got.host_ms == pytest.approx(idle)
    dp = predict_calibrated(cal, model, ParallelConfig(dp=4, global_batch=4))
    assert dp.host_ms == pytest.approx(0.5 * model_calls(predict, model, ParallelConfig(dp=4, global_batch=4), hw)
                                       ["dp_all_reduce"])
