"""GEMM, attention and memory-bound times: the curve, its fit, and held-out H200 measurements."""

import math
import statistics

import pytest

from overlapkit.costmodel import preset
from overlapkit.costmodel.calibration import HELD_OUT_ATTENTION_TP, split_gemm
from overlapkit.costmodel.gemm import GemmCurve, fit_gemm_curve, nelder_mead


def test_roofline_is_memory_bound_for_few_rows_and_compute_bound_for_many():
    c = GemmCurve(peak_fraction=0.75, mem_gbps=3000.0, launch_us=5.0, k_half=0.0)
    # m=16: 2*(16*8192 + 8192*7168 + 16*7168) bytes at 3 TB/s, plus the launch.
    assert c.roofline_ms(16, 8192, 7168, 1000.0, 2) == pytest.approx(
        0.005 + 2 * (16 * 8192 + 8192 * 7168 + 16 * 7168) / 3e9, rel=1e-9)
    assert c.roofline_ms(8192, 8192, 8192, 1000.0, 2) == pytest.approx(0.005 + 2 * 8192**3 / 0.75e15 * 1e3, rel=1e-9)


def test_table_reproduces_its_own_points_and_fades_far_away():
    c = GemmCurve(0.75, 3000.0, 5.0, 50.0, table=((4096, 4096, 4096, 0.5),))
    assert c.time_ms(4096, 4096, 4096, 1000.0, 2) == pytest.approx(0.5)
    far = c.time_ms(64, 512, 65536, 1000.0, 2)
    assert far == pytest.approx(c.roofline_ms(64, 512, 65536, 1000.0, 2), rel=1e-3)
    assert c.time_ms(4096, 4096, 4096, 1000.0, 2, dtype="fp8") == c.roofline_ms(4096, 4096, 4096, 1000.0, 2)


def test_fit_recovers_a_known_curve():
    truth = GemmCurve(0.7, 2500.0, 6.0, 80.0)
    shapes = [(m, k, n) for m in (16, 128, 1024, 8192) for k in (512, 4096, 16384) for n in (1024, 8192)]
    fitted = fit_gemm_curve([(*s, truth.roofline_ms(*s, 989.4, 2)) for s in shapes], 989.4)
    assert fitted.peak_fraction == pytest.approx(0.7, rel=0.02)
    assert fitted.mem_gbps == pytest.approx(2500.0, rel=0.02)
    assert fitted.launch_us == pytest.approx(6.0, rel=0.05)


def test_nelder_mead_finds_a_quadratic_minimum():
    x = nelder_mead(lambda p: (p[0] - 3) ** 2 + 2 * (p[1] + 1) ** 2, [0.0, 0.0])
    assert x == pytest.approx([3.0, -1.0], abs=1e-3)


def _errors(pairs):
    return [abs(p / m - 1) for p, m in pairs]


def test_held_out_gemm_shapes_are_predicted(calibration):
    hw = preset("h200-sxm")
    fitted, held = split_gemm(calibration["grid"])
    assert len(held) > 100
    fitted_shapes = {tuple(p[:3]) for p in hw.gemm.table}
    assert not fitted_shapes & {tuple(p[:3]) for p in held}, "a held-out shape leaked into the shipped table"
    errs = _errors((hw.gemm_ms(m, k, n), ms) for m, k, n, ms in held)
    assert statistics.median(errs) < 0.08 and max(errs) < 0.30


def test_chunked_gemm_efficiency_follows_the_probe(calibration):
    """The probe (never fitted): QKV keeps 0.92 at 4 chunks, 0.67 at 8, 0.45 at 16; FC2 ~1 to 16."""
    hw, probe = preset("h200-sxm"), calibration["probe"]["gemm"]

    def eff(m, k, n, x):
        return hw.gemm_ms(m, k, n) / (x * hw.gemm_ms(m // x, k, n))

    for x in (4, 8, 16):
        assert eff(8192, 8192, 1280, x) == pytest.approx(probe["qkv(AG+GEMM)"][f"x{x}_eff"], abs=0.1)
        assert eff(8192, 3584, 8192, x) == pytest.approx(probe["fc2(GEMM+RS)"][f"x{x}_eff"], abs=0.1)
    assert eff(8192, 8192, 1280, 8) < 0.75 < eff(8192, 3584, 8192, 8)


def test_small_m_gemms_run_under_a_third_of_peak(calibration):
    hw = preset("h200-sxm")
    tflops = {m: 2 * m * 8192 * 7168 / hw.gemm_ms(m, 8192, 7168) / 1e9 for m in (16, 32, 64, 128, 512)}
    assert tflops[64] < tflops[512] / 3
    for m, v in calibration["probe"]["small_m"].items():
        if int(m) in tflops:
            assert tflops[int(m)] == pytest.approx(v["tflops"], rel=0.15)


def test_held_out_attention_and_memory_bound_ops(calibration):
    hw, grid = preset("h200-sxm"), calibration["grid"]
    rows = [a for a in grid["attention"] if a["tp"] in HELD_OUT_ATTENTION_TP]
    errs = []
    for a in rows:
        f, b = hw.attention_ms(1, a["heads"], a["seq"], a["head_dim"])
        errs += _errors([(f, a["fwd_ms"]), (f + b, a["fwd_bwd_ms"])])
    assert statistics.median(errs) < 0.15 and max(errs) < 0.35
    for r in grid["memory_bound"]:
        n = r["tokens"] * r["hidden"]
        assert hw.memory.norm_ms(n, 2) == pytest.approx(r["layernorm_ms"], rel=0.1)
        # x + x moves two tensors; a two-stream op is slower per byte than the x + y it is fitted on
        # (test_model_memory_bandwidth.py), so two accesses price it fast, by at most 20%
        assert 0.8 * r["add_ms"] < hw.memory.elementwise_ms(n, 2, 2) < r["add_ms"]


def test_attention_is_causal_flops_at_a_share_of_peak():
    att = preset("h200-sxm").attention
    # 132 SMs full: 132 blocks = 2 heads x 66 query blocks of 128 rows.
    t = att.forward_ms(1, 2, 66 * 128, 128, 1000.0, 132) - att.launch_us * 1e-3
    assert t == pytest.approx(2 * 2 * (66 * 128) ** 2 * 128 / (1e9 * 1000.0 * att.peak_fraction))
    assert math.isclose(att.backward_ms(1, 2, 8448, 128, 1000.0, 132),
                        att.bwd_ratio * att.forward_ms(1, 2, 8448, 128, 1000.0, 132))
