"""`overlapkit bench gemm` on a real GPU: it measures, fits, and the planner reads what it wrote."""

import json
import statistics

import pytest
import torch

from overlapkit.costmodel import ParallelConfig, load_hardware, plan
from overlapkit.costmodel.bench_gemm import hardware_from_grid, measure
from overlapkit.costmodel.calibration import split_gemm
from overlapkit.costmodel.hardware import preset

# The folder's conftest skips collection without CUDA, but not a file named on the command line.
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_bench_gemm_writes_a_hardware_file_the_planner_reads(tmp_path):
    grid = measure(torch, quick=True, log=lambda s: None)
    assert len(grid["gemm"]) == 2 * 2 * 4 * 2 and grid["attention"] and grid["memory_bound"]
    hw = hardware_from_grid(grid, preset("h200-sxm"), torch.cuda.get_device_properties(0).multi_processor_count)
    points, _ = split_gemm(grid, held_out_m=())
    # The fitted curve reproduces what it measured (the table) and the roofline is in range.
    errs = [abs(hw.gemm_ms(m, k, n) / ms - 1) for m, k, n, ms in points]
    assert max(errs) < 1e-9
    roof = [abs(hw.gemm.roofline_ms(m, k, n, hw.bf16_tflops, 2) / ms - 1) for m, k, n, ms in points]
    assert statistics.median(roof) < 0.3
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(hw.to_dict()))
    report = plan("llama3-8b", str(path), ParallelConfig(tp=8))
    assert report.step_ms > 0 and load_hardware(str(path)).gemm.table == hw.gemm.table
