"""The memory-bound bandwidth: fitted on x + y at three accesses, never above a GPU's HBM peak."""

import pytest

from overlapkit.costmodel.calibration import FITTED_HIDDEN, add_probe, memory_curve, with_add_probe
from overlapkit.costmodel.hardware import PRESETS, preset


def test_every_preset_prices_memory_bound_ops_below_its_hbm_peak():
    # x + x counted as three accesses gave the H200 5.69 TB/s (A100 2.42, H100 3.97): above each peak
    for name in PRESETS:
        hw = preset(name)
        assert hw.memory.elementwise_gbps < 0.95 * hw.hbm_gbps, name
        assert hw.memory.norm_gbps < hw.hbm_gbps, name


def test_the_add_probe_x_plus_y_rows_are_priced_within_4_percent():
    # fitted at h = 8192; 4096 and 16384 held out (-3.4% and +1.6%)
    hw = preset("h200-sxm")
    for r in add_probe()["rows"]:
        n = 8192 * r["hidden"]
        assert hw.memory.elementwise_ms(n, 2) == pytest.approx(r["x_plus_y_ms"], rel=0.04), r["hidden"]


def test_x_plus_x_moves_two_tensors_not_three():
    # the probe's evidence: at three accesses x + x would beat the HBM peak; at two it does not
    hbm = preset("h200-sxm").hbm_gbps
    for r in add_probe()["rows"]:
        nbytes = 8192 * r["hidden"] * 2
        assert 3 * nbytes / r["x_plus_x_ms"] / 1e6 > hbm > 2 * nbytes / r["x_plus_x_ms"] / 1e6


def test_memory_curve_counts_x_plus_y_as_three_accesses_and_ignores_x_plus_x():
    row = dict(tokens=1000, hidden=FITTED_HIDDEN, layernorm_ms=8.192, add_ms=1e-9, x_plus_y_ms=6.0)
    curve = memory_curve({"memory_bound": [row]})
    elements = 1000 * FITTED_HIDDEN
    assert curve == pytest.approx({"elementwise_gbps": 3 * elements * 2 / 6.0 / 1e6,
                                   "norm_gbps": 2 * elements * 2 / 8.192 / 1e6})


def test_memory_curve_refuses_a_grid_with_only_x_plus_x():
    row = dict(tokens=8192, hidden=FITTED_HIDDEN, layernorm_ms=0.1, add_ms=0.07)
    with pytest.raises(ValueError, match="x_plus_y_ms"):
        memory_curve({"memory_bound": [row]})


def test_the_shipped_h200_bandwidth_is_the_probe_merged_into_the_grid(calibration):
    grid = with_add_probe(calibration["grid"], add_probe())
    assert all("x_plus_y_ms" in r for r in grid["memory_bound"])
    mem = preset("h200-sxm").memory
    assert memory_curve(grid) == pytest.approx({"elementwise_gbps": mem.elementwise_gbps, "norm_gbps": mem.norm_gbps})


def test_a_hardware_file_with_bandwidth_above_its_hbm_peak_is_refused():
    from dataclasses import replace

    from overlapkit.costmodel._validate import ConfigError
    from overlapkit.costmodel.gemm import MemoryCurve

    hw = preset("h200-sxm")
    with pytest.raises(ConfigError, match=r"memory\.elementwise_gbps=5694: must be at most hbm_gbps=4800"):
        replace(hw, memory=MemoryCurve(5693.6, hw.memory.norm_gbps))
    d = hw.to_dict()
    d["memory"]["elementwise_gbps"] = 5693.6  # what a grid's x + x counted as three accesses gave
    with pytest.raises(ConfigError, match="x \\+ x"):
        type(hw).from_dict(d)
